"""Where load_corpus caches the tokens on machines that differ from a developer's: the cache's disk
fills up while an entry is written, the user has no home directory. The cache saves time; losing
it never stops a run, and it never lands somewhere the user did not ask for.

Run: pytest tests/offload_trainer/app/data/test_corpus.py
"""

from __future__ import annotations

import errno
import os
import pwd
import warnings
from pathlib import Path
import pytest

from offload_trainer.app.data import ByteTokenizer, load_corpus
from offload_trainer.app.data import token_cache
from offload_trainer.app.data.corpus import cache_dirs
from offload_trainer.app.data.token_cache import CACHE_DIR_NAME, TEMP_MARKER, user_cache_dir
from offload_trainer.app.run_config import DataConfig

TEXT = "def add(a, b):\n    return a + b\n" * 50


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "corpus"
    path.mkdir(parents=True)
    (path / "a.py").write_text(TEXT)
    return path


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "offload-trainer" / "tokens"


def _disk_full_in(monkeypatch: pytest.MonkeyPatch, *full: Path) -> None:
    """Writes of entries in these directories fail with ENOSPC after their first bytes."""
    real = token_cache._FileSink._write

    def write(self: "token_cache._FileSink", tokens: object, trained: object) -> None:
        if self._tokens_path.parent in full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, tokens, trained)

    monkeypatch.setattr(token_cache._FileSink, "_write", write)


def _tokens(cfg: DataConfig) -> list:
    """The first training sequence's tokens: the corpus's first seq_len + 1 bytes."""
    return load_corpus(cfg, ByteTokenizer()).train_sequence(0).tolist()


FIRST = list(TEXT.encode()[:9])


def test_a_full_disk_beside_the_corpus_caches_in_the_users_directory(
    corpus: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beside = corpus.parent / CACHE_DIR_NAME
    _disk_full_in(monkeypatch, beside)
    cfg = DataConfig(path=str(corpus), seq_len=8, batch_size=2)
    with pytest.warns(UserWarning, match=f"could not be written in {beside} .No space left on device., so it was written in {user_cache}"):
        tokens = _tokens(cfg)
    assert tokens == FIRST
    assert os.listdir(beside) == []  # no temporary left
    assert len(list(user_cache.glob("*.json"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tokens(cfg) == tokens  # the next start maps that entry


def test_a_full_disk_everywhere_tokenizes_into_memory(corpus: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _disk_full_in(monkeypatch, corpus.parent / CACHE_DIR_NAME, user_cache)
    with pytest.warns(UserWarning, match="tokenized again at each start"):
        tokens = _tokens(DataConfig(path=str(corpus), seq_len=8, batch_size=2))
    assert tokens == FIRST
    assert not [n for d in (corpus.parent / CACHE_DIR_NAME, user_cache) for n in os.listdir(d) if TEMP_MARKER in n]


def test_a_full_disk_under_data_cache_dir_is_the_users_to_fix(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine"
    _disk_full_in(monkeypatch, mine)
    with pytest.raises(ValueError, match=r"data.cache_dir='.*mine': the token cache could not be written there \(No space"):
        _tokens(DataConfig(path=str(corpus), seq_len=8, batch_size=2, cache_dir=str(mine)))


def test_an_error_reading_the_corpus_is_not_taken_for_the_caches(corpus: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from offload_trainer.app.data import documents

    def unreadable(file: Path, other_encodings: object) -> str:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))

    monkeypatch.setattr(documents, "_read_text", unreadable)
    with pytest.raises(OSError) as raised:
        _tokens(DataConfig(path=str(corpus), seq_len=8, batch_size=2))
    assert raised.value.errno == errno.EIO and raised.value.filename == str(corpus / "a.py")
    assert not isinstance(raised.value, token_cache.CacheWriteError)


@pytest.fixture
def no_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME unset and no password entry: a container's arbitrary user id (`docker run -u 12345`)."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_entry(uid: int) -> None:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)


def test_without_a_home_nothing_is_cached_under_a_directory_named_tilde(
    tmp_path: Path, corpus: Path, no_home: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert user_cache_dir() is None
    assert cache_dirs(DataConfig(path=None, seq_len=8, batch_size=2), corpus) == []
    assert cache_dirs(DataConfig(path=str(corpus), seq_len=8, batch_size=2), corpus) == [corpus.parent / CACHE_DIR_NAME]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (corpus.parent).chmod(0o555)  # nothing beside the corpus either (root: a full disk there instead)
    _disk_full_in(monkeypatch, corpus.parent / CACHE_DIR_NAME)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens = _tokens(DataConfig(path=str(corpus), seq_len=8, batch_size=2))
    finally:
        corpus.parent.chmod(0o755)
    assert tokens == FIRST
    assert os.listdir(work) == []


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_cache_dir() == tmp_path / ".cache" / "offload-trainer" / "tokens"


def test_an_edit_that_keeps_size_and_modification_time_is_tokenized_again(corpus: Path, user_cache: Path) -> None:
    """The key named each file by path, size and modification time: an edit that kept the size, with
    the time put back (`touch -r`, `cp -p` over it, an rsync of equal-sized files), loaded the old
    text's entry, and the run trained on tokens the corpus no longer held. The key has the inode and
    the status-change time too, which no tool can set back."""
    cfg = DataConfig(path=str(corpus), seq_len=8, eval_fraction=0.1)
    assert _tokens(cfg) == FIRST
    a = corpus / "a.py"
    st = a.stat()
    edited = "X" * 9 + TEXT[9:]
    assert len(edited.encode()) == len(TEXT.encode())
    a.write_text(edited)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert a.stat().st_size == st.st_size and a.stat().st_mtime_ns == st.st_mtime_ns
    assert _tokens(cfg) == list(b"X" * 9)


def test_no_writable_cache_directory_says_the_corpus_is_tokenized_at_each_start(
    corpus: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only corpus directory and an unwritable home (a container run as another user): every start
    tokenized the whole corpus again, silently."""
    from offload_trainer.app.data import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "writable", lambda directory: False)
    with pytest.warns(UserWarning, match=rf"could not be written in {corpus.parent / CACHE_DIR_NAME} \(not writable\) "
                      rf"or {user_cache} \(not writable\), so the corpus is tokenized again at each start"):
        assert _tokens(DataConfig(path=str(corpus), seq_len=8, batch_size=2)) == FIRST


@pytest.mark.parametrize("cache_dir", [None, "named"])
def test_a_refused_corpus_leaves_no_cache_directory_it_made(tmp_path: Path, user_cache: Path, cache_dir) -> None:
    # The cache directory was made before the corpus was read: a refused run left an empty .offload-cache
    # beside the user's data (or the data.cache_dir it named, made for nothing).
    data = tmp_path / "data"
    data.mkdir()
    (data / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    named = tmp_path / "named" if cache_dir else None
    with pytest.raises(ValueError, match=r"bad.jsonl:2: bad JSON"):
        load_corpus(DataConfig(path=str(data / "bad.jsonl"), cache_dir=str(named) if named else None), ByteTokenizer())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nor the user's cache under xdg/
    assert sorted(p.name for p in data.iterdir()) == ["bad.jsonl"]


def test_a_cache_directory_that_was_there_stays(tmp_path: Path, corpus: Path) -> None:
    beside = corpus.parent / CACHE_DIR_NAME
    beside.mkdir()
    (corpus / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="bad JSON"):
        load_corpus(DataConfig(path=str(corpus)), ByteTokenizer())
    assert beside.is_dir()

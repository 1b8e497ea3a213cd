"""What a run's order of batches and its steps depend on, kept in each checkpoint, so that a resume over other
data, or with other steps, is refused.

    extra["data_identity"] = data_identity(cfg, data)                          # at each save
    check_same_data(extra.get("data_identity"), data_identity(cfg, data), ckpt)  # at resume: ValueError

A checkpoint keeps the data position (BatchStream: an epoch, and an index into that epoch's seeded
permutation of the training sequences). That position means something only over the same training
sequences under the same seed: resumed with another seed, or over other sequences (another
`data.seq_len`, `data.eval_fraction`, `data.max_tokens` that cuts elsewhere, field name, or files or a
tokenizer that now give other tokens), the run would go on at a position of another permutation,
silently seeing some sequences twice and others never in the epoch. Such a resume is refused in one
line naming what changed. So is one with another number of sequences per optimizer step
(`data.batch_size` x `grad_accum_steps`): a resume continues the same run, and its steps, each
of that many sequences under a learning rate scheduled by the step, would silently become another
run's. How a step's sequences are split into micro-batches and over ranks may change (a smaller
`data.batch_size` with a larger `grad_accum_steps` to fit memory: the same sequences per step), and
so may `data.path` itself (the position counts sequences, and a corpus moved elsewhere is the same
corpus) and a setting that leaves the sequences as they were (a `data.max_tokens` above the corpus's size).

The corpus is recognised by its token count, its number of training sequences and the CRC32 of all
its training sequences (tokens and loss marks): one read of them at each start, about what the token
cache's own check costs. (A CRC32 of the first and last sequences alone let a resume go on over a
corpus edited in between, which gives other tokens, without a word.) Checkpoints written before
the whole CRC32 was kept are checked by their first and last sequences (`ends_crc32`, still saved);
those written before any of this carry none and resume unchecked.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch

from offload_trainer.app.data import PackedDataset
from offload_trainer.app.run_config import RunConfig

_SETTINGS = ("seed", "data.seq_len", "data.eval_fraction", "data.max_tokens", "data.text_field", "data.messages_field")
"""The settings the training sequences and their order depend on, as a config file names them."""


def data_identity(cfg: RunConfig, data: PackedDataset) -> Dict[str, Any]:
    """The settings and the corpus's fingerprint (JSON-safe) that a checkpoint's data position depends on."""
    d = cfg.data
    values = (cfg.seed, d.seq_len, d.eval_fraction, d.max_tokens, d.text_field, d.messages_field)
    ends = data.train_sequences(torch.tensor([0, data.num_train_sequences - 1]))
    return {
        "settings": dict(zip(_SETTINGS, values)),
        "step": {"data.batch_size": d.batch_size, "grad_accum_steps": cfg.grad_accum_steps},
        "num_tokens": data.num_tokens,
        "num_train_sequences": data.num_train_sequences,
        "ends_crc32": zlib.crc32(ends.numpy().tobytes()),
        "train_crc32": data.train_crc32(),
    }


def check_same_data(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any], checkpoint: Path) -> None:
    """ValueError, one line naming what changed since `checkpoint` was saved, if its data position does
    not fit this run's data. `saved` None (a checkpoint of an older version): nothing to compare."""
    if not isinstance(saved, Mapping):
        return
    fix = (
        "start a new run (another train.out_dir, or --train.overwrite true; for a Hugging Face model, "
        "model.hf_path may name the last run's export)"
    )
    before = saved.get("settings")
    before = before if isinstance(before, Mapping) else {}
    changed = [k for k in _SETTINGS if k in before and before[k] != now["settings"][k]]
    again = " ".join(f"--{k} {_flag_value(before[k])}" for k in changed)
    if "seed" in changed:  # the order is drawn from it: the same sequences in another order are no resume either
        raise ValueError(
            f"{checkpoint} was saved with seed={before['seed']!r}, this run has seed={now['settings']['seed']!r}: the "
            f"data order and random state it continues were drawn from its seed; resume with {again}, or {fix}"
        )
    _check_same_step(saved.get("step"), now["step"], checkpoint, fix)
    compared = ("num_tokens", "num_train_sequences", "ends_crc32") + (("train_crc32",) if "train_crc32" in saved else ())
    if all(saved.get(k) == now[k] for k in compared):
        return  # the same sequences: a setting that changed nothing (max_tokens above the corpus's size) is fine
    if saved.get("num_train_sequences") != now["num_train_sequences"]:
        what = f"{saved.get('num_train_sequences')} training sequences then, {now['num_train_sequences']} now"
    else:
        what = "as many training sequences, but other tokens"
    if changed:
        was = ", ".join(f"{k}={before[k]!r} then, {now['settings'][k]!r} now" for k in changed)
        raise ValueError(
            f"{checkpoint} was saved over other data ({what}; {was}): its data position is one in the order of that "
            f"run's sequences; resume with {again}, or {fix}"
        )
    raise ValueError(
        f"{checkpoint} was saved over other data ({what}): the files of data.path or the tokenizer changed since, "
        f"and its data position is one in the order of the old sequences; resume with the data it was saved with, "
        f"or {fix}"
    )


def _check_same_step(saved: Any, now: Mapping[str, int], checkpoint: Path, fix: str) -> None:
    """ValueError unless this run's optimizer steps see as many sequences as the saved run's
    (data.batch_size x grad_accum_steps); `saved` None: a checkpoint saved before this was kept."""
    if not isinstance(saved, Mapping):
        return
    try:
        batch, accum = int(saved["data.batch_size"]), int(saved["grad_accum_steps"])
    except (KeyError, TypeError, ValueError):
        return  # not what data_identity writes (the manifest's checksum refuses an edit of it)
    before, per_step = batch * accum, now["data.batch_size"] * now["grad_accum_steps"]
    if before == per_step:
        return
    half = (
        f" (or --data.batch_size {batch // 2} --grad_accum_steps {accum * 2}: as many, in smaller micro-batches)"
        if batch % 2 == 0 else ""
    )
    raise ValueError(
        f"{checkpoint} was saved with data.batch_size={batch} x grad_accum_steps={accum} = {before} sequences per optimizer step, this run has data.batch_size="
        f"{now['data.batch_size']} x grad_accum_steps={now['grad_accum_steps']} = {per_step}: a resume continues the "
        f"same run; resume with --data.batch_size {batch} --grad_accum_steps {accum}{half}, or {fix}"
    )


def _flag_value(value: Any) -> str:
    return "none" if value is None else str(value)

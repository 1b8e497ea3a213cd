"""The trainer's data pipeline: documents -> tokens (cached on disk) -> packed sequences -> resumable batches.

    data = load_corpus(cfg.data, tokenizer)                # what offload-train does (corpus.py)
    data = PackedDataset(read_documents(path), ByteTokenizer(), seq_len=256)   # or by hand
    stream = BatchStream(data, batch_size=8, seed=0)
    inputs, targets, position_ids = stream.next_batch()    # LongTensor [8, 256] each; -100: not trained;
                                                           # position_ids restart per conversation (None: text)
    saved = stream.state_dict()                            # {"epoch", "position", "seed"}, JSON-safe
    for inputs, targets, position_ids in data.eval_batches(8): ...   # the held-out tail, same for every seed

One concept a file: tokenizer.py (byte and Hugging Face tokenizers, EOS/BOS), documents.py (the
readers: text, JSONL, parquet, saved datasets), chat.py (chat templates and the assistant's
tokens), token_stream.py (documents -> one token stream), token_cache.py (that stream on disk,
memory-mapped), packed_dataset.py (sequences and the eval split), batch_stream.py (the order),
corpus.py (all of it for a DataConfig).
"""

from offload_trainer.app.data.batch_stream import BatchStream
from offload_trainer.app.data.corpus import load_corpus, max_tokens_note
from offload_trainer.app.data.documents import (
    ACCEPTED_SUFFIXES,
    CorpusNotFoundError,
    Document,
    Fields,
    default_corpus_dir,
    iter_documents,
    load_documents,
    read_documents,
)
from offload_trainer.app.data.packed_dataset import IGNORE_INDEX, Batch, PackedDataset
from offload_trainer.app.data.token_stream import TokenStream
from offload_trainer.app.data.tokenizer import SEPARATOR_ID, ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ACCEPTED_SUFFIXES", "Batch", "BatchStream", "ByteTokenizer", "CorpusNotFoundError", "Document", "Fields",
    "HFTokenizer", "IGNORE_INDEX", "PackedDataset", "SEPARATOR_ID", "TokenStream", "Tokenizer", "default_corpus_dir",
    "iter_documents", "load_corpus", "load_documents", "max_tokens_note", "read_documents",
]

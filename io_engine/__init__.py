"""io_engine: tensor IO to files (NVMe) at the disk's speed, from plain Python.

Threads issuing os.preadv/os.pwritev (which release the GIL) keep several aligned O_DIRECT
requests in flight; buffers come from page-aligned host arenas allocated once (of 2 MiB or more:
private anonymous memory advised for transparent huge pages; smaller: MAP_SHARED anonymous
memory; see [Note: Why huge pages] in buffers.py). run_pass moves a whole file with a fixed
number of requests in flight. FileStore keeps swap files in a directory locked by its live owner
(reclaimed by the next run if the owner dies) and checks a checksum of every chunk it reads back.
This package never imports offload_trainer.
"""

from .atomic_file import atomic_open, fsync_dir, open_append, open_exclusive, write_atomic
from .buffers import HostArena, aligned_empty
from .config import DirectMode, IOConfig
from .engine import IOEngine, Segment
from .errors import (
    BufferedFallbackWarning,
    DirectIOUnsupportedError,
    IntegrityError,
    LostWriteError,
    NotEnoughSpaceError,
    ShortTransferError,
    SwapReclaimWarning,
    TransferError,
)
from .file import IOFile
from .file_store import Extent, FileStore
from .handle import IOHandle
from .pipelined_pass import run_pass

__all__ = [
    "BufferedFallbackWarning",
    "DirectIOUnsupportedError",
    "DirectMode",
    "Extent",
    "FileStore",
    "HostArena",
    "IOConfig",
    "IOEngine",
    "IOFile",
    "IOHandle",
    "IntegrityError",
    "LostWriteError",
    "NotEnoughSpaceError",
    "Segment",
    "ShortTransferError",
    "SwapReclaimWarning",
    "TransferError",
    "aligned_empty",
    "atomic_open",
    "fsync_dir",
    "open_append",
    "open_exclusive",
    "run_pass",
    "write_atomic",
]

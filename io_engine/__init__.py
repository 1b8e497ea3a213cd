"""io_engine: tensor IO to files (NVMe) at the disk's speed, from plain Python.

Threads issuing os.preadv/os.pwritev (which release the GIL) keep several aligned O_DIRECT
requests in flight; buffers come from page-aligned shared-memory arenas allocated once. This
package never imports offload_trainer.
"""

from .buffers import BufferPool, HostArena, PooledBuffer, aligned_empty
from .config import DirectMode, IOConfig
from .engine import IOEngine
from .errors import DirectIOUnsupportedError, NotEnoughSpaceError, ShortTransferError, TransferError
from .file import BufferedFallbackWarning, IOFile
from .file_store import Extent, FileStore
from .handle import IOHandle

__all__ = [
    "BufferPool",
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
    "NotEnoughSpaceError",
    "PooledBuffer",
    "ShortTransferError",
    "TransferError",
    "aligned_empty",
]

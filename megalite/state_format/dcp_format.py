"""Sharded state dicts on ``torch.distributed.checkpoint`` (DCP), resharded on load.

Why a tensor-like wrapper: DCP reshards any tensor whose pieces it knows as
``ChunkStorageMetadata`` (global offsets + sizes).  megalite's state
(``sharded_state.ShardedTensor``) has, per rank, *several* chunks of a tensor (fused
``[gate; up]`` blocks, a distributed-optimizer range cut into rectangles), which neither a
DTensor placement nor a plain tensor can describe.  ``ChunkedTensor`` speaks DCP's
checkpointable protocol (``__create_write_items__`` / ``__create_chunk_list__`` /
``__get_tensor_shard__``, the hooks DTensor itself uses), so DCP's own planner, storage
writer and resharding reader do the work; non-writers simply contribute no write items.

Security: DCP keeps its global metadata as a pickle and reads non-tensor entries with
``torch.load(weights_only=False)``.  ``SafeFileSystemReader`` unpickles the metadata with an
allow-list of DCP's own dataclasses (anything else is refused), and ``SafeLoadPlanner``
refuses pickled entries outright, so loading a checkpoint never runs code from it.  Tensor
data itself is read by DCP with ``weights_only=True``.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import types
import warnings
import traceback
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex,
                                                       TensorStorageMetadata)

# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor and
# torch._dynamo, ~0.5 s of start-up that a process which never saves or loads (a torchrun
# worker of a run without --save, a one-line user error) should not pay.

METADATA_FILE = ".metadata"


class ChunkedTensor:
    """A global tensor of ``global_shape`` of which this rank holds ``chunks`` (``(global
    offsets, local tensor)``); ``writer``: this rank's chunks go to disk (one copy of each
    replicated chunk is written)."""

    def __init__(self, global_shape: Sequence[int], chunks: Sequence[Tuple[tuple, torch.Tensor]],
                 writer: bool = True):
        self.global_shape = torch.Size(global_shape)
        self.chunks = [(torch.Size(o), t) for o, t in chunks]
        self.writer = writer

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj) -> list:
        # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                           TensorProperties)
        # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
        if not self.writer:
            return []
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.global_shape))
                for off, t in self.chunks]

    def __create_chunk_list__(self) -> list:
        # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.chunks) and \
                self.chunks[index.index][0] == index.offset:
            return self.chunks[index.index][1]
        for off, t in self.chunks:
            if off == index.offset:
                return t
        raise ValueError(f"'{index.fqn}': no local chunk at offsets {tuple(index.offset)}")


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, ChunkedTensor) else None


# DCP's metadata pickle holds only these classes (plus builtins); nothing else is trusted.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch.distributed.checkpoint.planner", "WriteItemType"),
     ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
     ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{self.path}: refusing to unpickle '{module}.{name}' "
                                     f"(not part of DCP metadata)")


def read_dcp_metadata(directory: str) -> Metadata:
    """DCP's global metadata of ``directory``, unpickled with the allow-list."""
    path = os.path.join(directory, METADATA_FILE)
    with open(path, "rb") as f:
        try:
            meta = _MetadataUnpickler(f, path).load()
        except pickle.UnpicklingError:
            raise
        except Exception as exc:  # truncated or garbled pickle
            raise ValueError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: "
                             f"{exc})") from None
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint.metadata import Metadata
    if not isinstance(meta, Metadata):
        raise ValueError(f"{path}: not DCP metadata ({type(meta).__name__})")
    return meta


@functools.lru_cache(maxsize=None)
def _dcp_classes() -> types.SimpleNamespace:
    """The DCP planner and reader subclasses, defined at the first save or load (their bases
    live in torch.distributed.checkpoint)."""
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    import torch.distributed.checkpoint as dcp
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint.metadata import StorageMeta

    class ChunkedSavePlanner(DefaultSavePlanner):
        """DCP's default save planner, resolving ``ChunkedTensor`` chunks by offset."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def lookup_object(self, index: MetadataIndex):
            found = _lookup(self.state_dict, index)
            return found if found is not None else super().lookup_object(index)

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default (resharding) load planner that never unpickles a checkpoint entry."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                             allow_partial_load=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            # The default set-up first materializes meta tensors in place, which would replace
            # ChunkedTensor values; ours hold real tensors already.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            found = _lookup(self.state_dict, index)
            return found if found is not None else super().lookup_tensor(index)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            raise ValueError(f"checkpoint entry '{read_item.dest_index.fqn}' is a pickled object; "
                             f"megalite never unpickles checkpoint contents")

    class SafeFileSystemReader(dcp.FileSystemReader):
        """DCP's file reader whose metadata is unpickled with the allow-list."""

        def read_metadata(self, *args, **kwargs) -> Metadata:
            meta = read_dcp_metadata(str(self.path))
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return types.SimpleNamespace(dcp=dcp, save_planner=ChunkedSavePlanner,
                                 load_planner=SafeLoadPlanner, reader=SafeFileSystemReader)


def _pg_args(single: bool, group=None) -> dict:
    """A run of one rank (possibly inside a larger test process group) is not collective."""
    if single or not dist.is_initialized() or dist.get_world_size() == 1:
        return {"no_dist": True}
    return {"process_group": group}


class CheckpointIOError(RuntimeError):
    """A DCP save or load that failed on some rank, as one line on every rank (the
    checkpointer decides whether the cause is the user's filesystem or a bug)."""


@contextlib.contextmanager
def _one_line_failure(what: str, directory: str):
    """DCP reports a failure on any rank to every rank as a ``CheckpointException`` (a
    BaseException carrying tracebacks); make it one ordinary error line naming the
    directory, the ranks and the first cause (e.g. ENOSPC)."""
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint import CheckpointException
    try:
        yield
    except CheckpointException as exc:
        ranks = sorted(exc.failures)
        cause = exc.failures[ranks[0]][0] if ranks else exc
        if os.environ.get("MEGALITE_DEBUG_DCP"):
            for r in ranks:
                print(f"--- DCP failure on rank {r}:\n" + "".join(traceback.format_exception(
                    exc.failures[r][0])) + str(exc.failures[r][1]), flush=True)
        first = (str(cause).strip().splitlines() or [""])[0]
        raise CheckpointIOError(f"{what} {directory} failed on rank(s) {ranks}: "
                              f"{type(cause).__name__}: {first}") from cause


def save_chunked(state_dict: Dict[str, object], directory: str, single: bool = False,
                 group=None) -> None:
    """Write ``state_dict`` (``ChunkedTensor`` values) with DCP; collective over ``group``
    (default: the world) unless ``single``.  Every rank writes its own files in parallel."""
    os.makedirs(directory, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        with _one_line_failure("saving", directory):
            c = _dcp_classes()
            c.dcp.save(state_dict,
                       storage_writer=c.dcp.FileSystemWriter(directory, thread_count=1),
                       planner=c.save_planner(), **_pg_args(single, group))


def load_chunked(state_dict: Dict[str, object], directory: str, single: bool = False) -> None:
    """Fill the chunks of ``state_dict`` from a DCP checkpoint saved at any layout."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        with _one_line_failure("loading", directory):
            c = _dcp_classes()
            c.dcp.load(state_dict, storage_reader=c.reader(directory),
                       planner=c.load_planner(), **_pg_args(single))


def saved_tensors(directory: str) -> Dict[str, TensorStorageMetadata]:
    """{key: DCP tensor metadata (global size, dtype)} of a DCP checkpoint."""
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return {k: v for k, v in read_dcp_metadata(directory).state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def load_full(directory: str, keys: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
    """Full tensors of ``keys`` (default: all) from a DCP checkpoint; single process."""
    metas = saved_tensors(directory)
    keys = list(metas) if keys is None else list(keys)
    out = {k: torch.empty(metas[k].size, dtype=metas[k].properties.dtype) for k in keys}
    sd = {k: ChunkedTensor(t.shape, [((0,) * t.dim(), t)]) for k, t in out.items()}
    load_chunked(sd, directory, single=True)
    return out

"""The boundary store: the teacher's residual stream at every boundary, as versioned, sharded,
checksummed HDF5 (the cache of ZeroGraph's materialised boundary supervision).

This package owns the store's format and everything that reads or writes it:

* ``common``: format version, storage dtypes, errors, finiteness, per-channel RMS statistics
  (the one definition, also used by online targets and the report);
* ``shards``: the shard plan, writing one shard (the teacher over a contiguous range of
  sequences; one file per boundary, an xxh3_64 checksum per sequence), the join (manifest and statistics),
  and :func:`build_store` (all of it in one process, without a task graph);
* ``reader``: :class:`BoundaryReader` (batches through the manifest; opens only the files of the
  boundaries it reads);
* ``online``: :class:`OnlineBoundaries` (online targets with the reader's interface).

Training code asks this package for batches and never touches h5py.
"""
from .common import (FORMAT_VERSION, H5_DTYPES, READABLE_VERSIONS, STATS_SEQUENCES, TORCH_DTYPES, BoundaryStoreError, channel_rms,
                     check_finite, from_storage, planned_bytes, quarantine, rms_from_sumsq, round_trip, sequence_checksums,
                     sequence_sumsq, to_storage)
from .online import OnlineBoundaries
from .reader import BoundaryReader
from .shards import MANIFEST, SHARD_FILE, build_store, join_shards, plan_shards, read_shard_record, shard_problem, write_shard

__all__ = ["FORMAT_VERSION", "H5_DTYPES", "READABLE_VERSIONS", "STATS_SEQUENCES", "TORCH_DTYPES", "BoundaryStoreError", "channel_rms",
           "check_finite", "from_storage", "planned_bytes", "quarantine", "rms_from_sumsq", "round_trip",
           "sequence_checksums", "sequence_sumsq", "to_storage", "OnlineBoundaries", "BoundaryReader", "MANIFEST", "SHARD_FILE",
           "build_store", "join_shards", "plan_shards", "read_shard_record", "shard_problem", "write_shard"]

"""genrec.data: event logs -> per-user sequences -> jagged batches.

Holds the event-log schema and converters (`convert`, `synth`), the out-of-core sequence
preparation with its splits (`prepare`, and `logfiles`: which files a log is, checked
before any work), the resumable sharded loader yielding `Batch`
(`loader`, `batch`), and the file-safety helpers of every floor above (`files`: atomic
writes, fsync, checksums, the overwrite rule).

May import: torch, torchrec's jagged types, pyarrow, numpy, tqdm. Never `genrec.sparse`,
`genrec.dense` or `genrec.models` (a ground floor).
"""

"""``gatherstore bench``: gatherstore's stores against the usual tools, on the same payloads.

Modules: ``suite`` (the default run: every case, its ceilings and floors, the report),
``kinds`` and ``payloads`` (synthetic data), ``baselines`` (torch.distributed,
mmengine), ``cases`` (what is compared), ``ceilings`` (the machine's limits),
``floors`` (a gather's own limits: encoding a part, decoding the others),
``clients`` (Redis and S3 client libraries alone), ``runner`` (fresh processes
per case), ``report`` (table, JSON lines, chart), ``metrics`` (torchmetrics'
MeanAveragePrecision synced three ways; opt-in).  The other modes have a module each
(``scale``, ``latency``, ``soak``, ``resultsets``, ``exports``, ``hostbench``,
``parts``, ``groups``).

The package imports nothing itself: the command's parser reads ``kinds`` without
importing torch.
"""

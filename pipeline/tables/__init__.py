"""Delta tables (delta-rs): the commit protocol ending in one Delta log entry, the source ledger
of only-new-files runs, the Delta types and schema rules, and the snapshot readers.

* :mod:`.deltalog`  the one module that talks to ``deltalake``
* :mod:`.types`     Arrow types as a Delta table stores them; appending a run's schema to a table's
* :mod:`.ledger`    which input files a table holds (commit metadata), new and changed inputs
* :mod:`.job`       :class:`~.job.DeltaJob`: :class:`pipeline.commit.OutputJob` ending in a log entry
* :mod:`.snapshot`  reading a table's snapshot (its files, at a version) for the stages and Spark
"""

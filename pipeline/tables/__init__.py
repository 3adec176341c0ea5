"""Lakehouse tables: Delta Lake (`deltalake`, delta-rs) and Iceberg (`pyiceberg`), read at one pinned version
and appended to in one commit, through the libraries' Python APIs (no Spark jars: these clusters cannot
fetch them, and many lack them).

- ``pin``: the table at the configured (or the current) version, resolved once, as the list of data files
  Spark's tasks read (``pipeline.tables.pinned.PinnedTable``);
- ``changes``: what was committed since a version the workflow trained on (appends only, or why not);
- ``delta_write`` / ``iceberg_write``: `shardline score`'s output appended as one commit, of the files
  Spark's tasks staged (``staging``).

Both libraries are optional extras (``shardline[delta]``, ``shardline[iceberg]``), imported inside the
functions that need them; a missing one is a TableError naming the extra.
"""

"""Data assignment: pure, seeded schemes (``schemes``) and their one-pass Spark materialisation
(``materialize``: worker directories, eval splits and ``manifest.json``)."""

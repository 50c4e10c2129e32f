"""HEP features: Delphes selection + HLF/LLF (``delphes``), scaling statistics (``scaling``) and the
Spark stage that writes the ``hlf/`` and ``llf/`` datasets (``stage``). Import-light on purpose."""

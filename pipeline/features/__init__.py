"""HEP features: the layout constants (``layout``: names, caps, sizes, class labels), Delphes
selection + HLF/LLF (``delphes``, with its numba kernels in ``kernels``), scaling statistics
(``scaling``) and the Spark stage that writes the ``hlf/`` and ``llf/`` datasets (``stage``).
Import-light on purpose."""

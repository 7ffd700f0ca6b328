"""Front-ends: the ``dpara-rt`` command (``cli``), side-by-side comparisons (``compare``) and the end-to-end
benchmark (``bench_e2e``)."""

"""The research tools, beside the library they measure (issue 22).

``harness`` (one problem, one row per implementation), ``compare`` (``numba-flash compare``:
FA-1 against FA-2), ``ablation`` (``numba-flash ablate``: the FA-1 -> FA-2 factor space),
``tuning`` (``numba-flash autotune``), ``report`` (the tables), ``cli`` (the ``numba-flash``
command, also ``python -m numba_flash``) and ``profiling/`` (FLOP and byte counts, GPU timing,
kernel resources, occupancy, Nsight Compute). They sit above the API and call it; the library
below never imports them (``distributed.demo``, the ring's ``torchrun`` command, borrows the
CLI's argument types, the FLOP count and the table writer).
"""

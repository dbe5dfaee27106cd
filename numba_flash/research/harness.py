"""One problem, one row per implementation: what ``compare``, ``ablate`` and ``scripts/bench.py`` measure.

A problem (:func:`describe`) is built once (:func:`make_problem`): standard-normal inputs from a
seed, and the part of the output that the float64 reference checks (:func:`check_scope`). Every
implementation then runs on those inputs, and :func:`measure` gives its row (:func:`new_row`'s
keys, ``None`` where nothing was measured):

- a numba_flash kernel (``fa1``, ``fa2``, or an ablation variant of their loop order): error
  against the reference, modelled global-memory traffic, launch shape; on a GPU also the median
  time (CUDA events, warm-up excluded), TFLOP/s and the compiled kernel's registers and occupancy;
- a peer (:func:`peer_names`: ``cupy``, the matmul-softmax-matmul baseline; ``torch-<backend>``,
  PyTorch SDPA): its median time and TFLOP/s (GPU only).

With ``backward=True`` a row also holds the backward pass: for a kernel,
``numba_flash.attention_backward`` of its own (o, lse) for a seeded upstream gradient, its
gradients' error against float64 (``reference.attention_backward``) and, on a GPU, its median
time and TFLOP/s; for a PyTorch peer, the time of ``torch.autograd.grad`` through its SDPA. The
backward's FLOPs are 2.5x the forward's (five products of the size of the forward's two), as
the FlashAttention papers count them.

:func:`measure_or_fail` is :func:`measure` that never raises: a failure (out of memory, a backend
refusing the shape) becomes the row's status.
"""

from __future__ import annotations

import sys

import numpy as np

from numba_flash._world import simulated
from numba_flash.problem import ALGORITHMS, regime
from numba_flash.research.profiling.timing import attention_flops, median_ms, tflops
from numba_flash.research.profiling.traffic import traffic_bytes
from numba_flash.specs import kernel_spec

WARMUP = 3  # untimed calls before timing (the check before them has compiled)
GRAD_REF_BUDGET_BYTES = 10**9  # float64 scores the NumPy gradient reference may hold (host memory)
BACKWARD_FLOPS = 2.5  # backward FLOPs / forward FLOPs
REF_BUDGET_BYTES = 16 * 10**9  # largest float64 score matrix the reference may build (B4 H16 N4096: 8.6 GB, all heads)


def describe(batch, heads, seq, head_dim, dtype="float32", causal=False, *, kv_heads=None, seq_k=None,
             block_m=None, block_n=None, precision=None) -> dict:
    """A problem as the harness reads it: K/V heads and key length (default: ``heads``, ``seq``),
    tiles (``None``: the kernels' defaults) and precision (``None``: the dtype's regime)."""
    return dict(batch=batch, heads=heads, kv_heads=heads if kv_heads is None else kv_heads, seq=seq,
                seq_k=seq if seq_k is None else seq_k, head_dim=head_dim, block_m=block_m, block_n=block_n,
                causal=bool(causal), dtype=dtype, precision=precision)


def check_scope(batch: int, heads: int, n_q: int, n_k: int, budget: int = REF_BUDGET_BYTES) -> tuple[bool, int, str]:
    """Which part of the output the float64 reference checks: ``(all_heads, rows, label)``.

    All of it when the float64 scores (B*H*Nq*Nk*8 bytes) fit ``budget``; else batch 0,
    head 0, and of it the last ``rows`` query rows that fit. A suffix of the queries is
    a faithful sub-problem even when causal: with bottom-right alignment (key j visible
    to query i iff j <= i + Nk - Nq) the last rows see exactly the keys they see in full.
    """
    if batch * heads * n_q * n_k * 8 <= budget:
        return True, n_q, "all"
    rows = max(1, min(n_q, budget // (n_k * 8)))
    return False, rows, "head 0" if rows == n_q else f"head 0, last {rows} rows"


def make_problem(p: dict, seed: int) -> dict:
    """The inputs of problem ``p`` (:func:`describe`), standard normal from ``seed``: NumPy arrays
    in the simulator, CuPy arrays on a GPU (torch tensors for bfloat16, which CuPy lacks); and the
    part of the output the reference checks (:func:`check_scope`). The reference itself is
    computed when a kernel's row first needs it (:func:`reference_output`), so that a reference
    out of memory fails those rows only. ``ValueError`` for a precision the dtype does not have."""
    B, H, Hkv, Nq, Nk, D = (p[key] for key in ("batch", "heads", "kv_heads", "seq", "seq_k", "head_dim"))
    mode = regime(p["precision"], p["dtype"])
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(shape, dtype=np.float32) for shape in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D))]
    all_heads, rows, scope = check_scope(B, H, Nq, Nk, REF_BUDGET_BYTES)
    heads = slice(None) if all_heads else slice(0, 1)
    sim = simulated()
    if sim:  # (bfloat16: ml_dtypes)
        q, k, v = (x.astype(numpy_dtype(p["dtype"])) for x in host)
    elif p["dtype"] == "bfloat16":  # rounded by torch as ml_dtypes rounds (to nearest even)
        import torch

        q, k, v = (torch.as_tensor(x, device="cuda").to(torch.bfloat16) for x in host)
    else:
        import cupy

        q, k, v = (cupy.asarray(x.astype(p["dtype"])) for x in host)
    return dict(p=p, mode=mode, q=q, k=k, v=v, sim=sim, seed=seed, flops=attention_flops(B, H, Nq, Nk, D, p["causal"]),
                checked=(heads, heads, slice(Nq - rows, None)),  # the last `rows` queries of the checked heads
                rel_err_scope=scope, ref_o=None)


def reference_output(problem):
    """The float64 output of the checked part of the problem (NumPy's ``reference.attention`` in
    the simulator, ``cupy_attention`` on the GPU), computed on first use and kept in ``problem``."""
    if problem["ref_o"] is None:
        checked, causal = problem["checked"], problem["p"]["causal"]
        q64 = _float64(problem["q"][checked])
        k64, v64 = (_float64(problem[name][checked[:2]]) for name in ("k", "v"))
        if problem["sim"]:
            from numba_flash import reference

            problem["ref_o"], _ = reference.attention(q64, k64, v64, causal=causal)
        else:
            import cupy

            from numba_flash.baselines import cupy_attention

            ref_o = cupy_attention(*(cupy.asarray(x) for x in (q64, k64, v64)), causal=causal)
            if hasattr(q64, "double"):  # torch inputs (bfloat16): a torch reference
                import torch

                ref_o = torch.as_tensor(ref_o, device="cuda")
            problem["ref_o"] = ref_o
    return problem["ref_o"]


def new_row(p: dict, impl: str, status: str | None = None) -> dict:
    """A row of ``impl`` on problem ``p`` with every key a measurement may fill, ``None`` until it does."""
    return dict(
        impl=impl,  # fa1, fa2, cupy, torch-<backend>
        algorithm=None,  # kernels: the loop order's family (fa1: K/V outer, fa2: Q outer)
        regime=None,  # kernels: CUDA cores or tensor cores (which mma)
        **{key: p[key] for key in ("batch", "heads", "kv_heads", "seq", "seq_k", "head_dim", "dtype", "causal")},
        block_m=None, block_n=None, num_splits=None,  # kernels: split-KV count (1: unsplit)
        max_abs_err=None, rel_err=None,
        rel_err_scope=None,  # check_scope's label of the part checked
        modelled_bytes=None,  # profiling.traffic's global-memory bytes
        smem_bytes=None, threads=None, blocks=None,  # per block, the grid's size
        ms=None, tflops=None,  # GPU only, as the compiled kernel's resources that follow
        grad_rel_err=None, grad_rel_err_scope=None,  # backward: max relative error of dq, dk, dv
        bwd_ms=None, bwd_tflops=None,  # backward: median time (GPU), TFLOP/s at BACKWARD_FLOPS
        regs=None, local_bytes=None, blocks_per_sm=None, warps_per_sm=None, occupancy=None,
        extra_mem_bytes=None,  # device memory one call takes beyond its inputs and o (when asked)
        status=status,  # "ok", or why there are no figures ("failed: ...")
    )  # fmt: skip


def measure(problem, impl, repeats, *, warmup=WARMUP, variant=None, device_memory=False, backward=False) -> dict:
    """The row of ``impl`` on the problem of :func:`make_problem`: a kernel (``fa1``, ``fa2``; with
    ``variant``, that point of the ablation space on CUDA cores) or a peer (:func:`peer_names`).
    ``device_memory`` (kernels, GPU): also the device memory one call takes beyond its inputs and
    its output o. ``backward``: also the backward pass (the module's docstring; the CuPy baseline
    has none). Raises what the implementation raises (``ValueError`` for tiles it refuses)."""
    if impl in ALGORITHMS:
        return _measure_kernel(problem, impl, repeats, warmup, variant, device_memory, backward)
    if impl == "fa3":
        return _measure_fa3(problem, repeats, warmup)
    row = new_row(problem["p"], impl, "ok")
    ms = median_ms(_peer_call(problem, impl), warmup=warmup, repeats=repeats)
    row.update(ms=ms, tflops=tflops(problem["flops"], ms))
    if backward and impl != "cupy":
        bwd_ms = median_ms(_peer_backward_call(problem, impl), warmup=warmup, repeats=repeats)
        row.update(bwd_ms=bwd_ms, bwd_tflops=tflops(BACKWARD_FLOPS * problem["flops"], bwd_ms))
    return row


def measure_or_fail(problem, impl, repeats, **options) -> dict:
    """:func:`measure` that never raises: a failure is the row's status (``failed: <type>: <message>``).
    Cached device memory is released after it, so that the next implementation has it all."""
    try:
        return measure(problem, impl, repeats, **options)
    except Exception as exc:  # cupy.cuda.memory.OutOfMemoryError, torch errors, CUDA errors, ...
        return new_row(problem["p"], impl, failure(exc))
    finally:
        release_memory()


def peer_names(dtype: str) -> list[str]:
    """The peers that run on ``dtype`` here: ``cupy`` (except bfloat16) and each torch SDPA backend."""
    from numba_flash.baselines import torch_sdpa_backends

    return ([] if dtype == "bfloat16" else ["cupy"]) + list(torch_sdpa_backends(dtype))


def time_ratio(slower: dict | None, faster: dict | None) -> float | None:
    """``slower``'s time over ``faster``'s (> 1: ``faster`` is faster); ``None`` unless both were timed."""
    if not (slower and faster and slower["ms"] and faster["ms"]):
        return None
    return slower["ms"] / faster["ms"]


def failure(exc: BaseException) -> str:
    """A row's status for an exception: its type and the first line of its message."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"failed: {type(exc).__name__}: {first_line[:200]}"


def release_memory() -> None:
    """Return cached device memory (CuPy's pool, torch's cache) to the device; nothing in the simulator."""
    if simulated():
        return
    try:
        import cupy as cp

        cp.cuda.Device().synchronize()
        cp.get_default_memory_pool().free_all_blocks()
        if "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()
    except Exception:  # a broken context already failed the measurement; keep measuring
        pass


_MMA_NAME = {"f16": "mma.sync f16", "bf16": "mma.sync bf16", "tf32": "mma.sync tf32", "tf32x3": "mma.sync 3xTF32"}


def _measure_kernel(problem, algorithm, repeats, warmup, variant, device_memory, backward=False) -> dict:
    import warnings

    from numba_flash.api import choose_tiles, forward
    from numba_flash.simulator import SimulatorSlowWarning
    from numba_flash.split_kv import choose_num_splits

    p, mode, q, k, v = (problem[key] for key in ("p", "mode", "q", "k", "v"))
    B, H, Hkv, Nq, Nk, D = (p[key] for key in ("batch", "heads", "kv_heads", "seq", "seq_k", "head_dim"))
    bm, bn = choose_tiles(mode, algorithm, D, p["dtype"], p["causal"], p["block_m"], p["block_n"])  # as attention does
    spec = kernel_spec(algorithm, D, p["dtype"], bm, bn, p["causal"], mode, variant=variant)
    # The split-KV count attention's heuristic gives this call (variants: never split). On tensor
    # cores a split call runs another kernel (float32 partials), whose resources the row reports.
    splits = 1 if variant is not None else choose_num_splits(None, spec, B, H, Nq, Nk, None)
    if splits > 1 and mode != "ieee":
        spec = kernel_spec(algorithm, D, p["dtype"], bm, bn, p["causal"], mode, split_out=True)

    def run():
        return forward(q, k, v, causal=p["causal"], algorithm=algorithm, block_m=bm, block_n=bn,
                       precision=p["precision"], variant=variant, num_splits=splits)

    with warnings.catch_warnings():  # the caller says how long the simulator takes
        warnings.simplefilter("ignore", SimulatorSlowWarning)
        o, lse = run()
    row = new_row(p, algorithm, "ok")
    row.update(
        algorithm=algorithm,
        regime="CUDA cores (FFMA)" if mode == "ieee" else f"tensor cores ({_MMA_NAME[mode]})",
        block_m=bm,
        block_n=bn,
        **_errors(o, problem),
        modelled_bytes=traffic_bytes(algorithm, B, H, Hkv, Nq, Nk, D, bm, bn, p["dtype"], p["causal"],
                                     tensor_cores=mode != "ieee", variant=variant),
        smem_bytes=spec.smem_bytes,  # the driver's figure replaces it on a GPU
        threads=spec.threads,
        blocks=spec.grid(B, H, Nq, splits)[0],
        num_splits=splits,
    )
    if backward:
        row.update(_backward(problem, algorithm, o, lse, repeats, warmup))
    del o, lse
    if not problem["sim"]:
        from numba_flash.research.profiling.resources import compiled_resources

        if device_memory:
            row["extra_mem_bytes"] = _extra_device_bytes(run)
        ms = median_ms(run, warmup=warmup, repeats=repeats)
        row.update(ms=ms, tflops=tflops(problem["flops"], ms))
        row.update(compiled_resources(spec.kernel, spec.threads, spec.dynamic_smem).as_dict())
    return row


def _measure_fa3(problem, repeats, warmup) -> dict:
    """The row of ``algorithm="fa3"`` (FlashAttention-3 on Hopper, ``numba_flash.fa3``): FA-2's
    fields, its tiles and launch; the traffic model is FA-2's at the same tiles (the same loop
    order: Q_i read once, K_j and V_j once per Q tile)."""
    from numba_flash import fa3
    from numba_flash.kernels.fa3 import check_fa3_tiles
    from numba_flash.problem import describe as describe_problem
    from numba_flash.tile_table import fa3_tiles

    p, q, k, v = (problem[key] for key in ("p", "q", "k", "v"))
    B, H, Hkv, Nq, Nk, D = (p[key] for key in ("batch", "heads", "kv_heads", "seq", "seq_k", "head_dim"))
    kernel_dim = fa3.kernel_head_dim(D)
    dm, dn, stages = fa3_tiles(kernel_dim)
    bm, bn = p["block_m"] or dm, p["block_n"] or dn
    try:  # the tiles compare was given or defaulted to (FA-1 and FA-2's), where fa3 can build them
        check_fa3_tiles(kernel_dim, bm, bn, stages)
    except ValueError:
        bm, bn = dm, dn

    def run():
        return fa3.forward(q, k, v, causal=p["causal"], block_m=bm, block_n=bn, num_splits=1)  # (the row's)

    o, _ = run()
    from numba_flash.arrays import kind_of

    kernel = fa3.kernel_for(describe_problem(q, k, v, causal=p["causal"]), kernel_dim, bm, bn, stages,
                            tma_store=fa3.stores_o_by_tma(o, kind_of(o), False, 1))  # the kernel run() ran
    row = new_row(p, "fa3", "ok")
    row.update(
        algorithm="fa3",
        regime=f"tensor cores (wgmma {'f16' if p['dtype'] == 'float16' else 'bf16'}, TMA, warp-specialized)",
        block_m=bm,
        block_n=bn,
        **_errors(o, problem),
        modelled_bytes=traffic_bytes("fa2", B, H, Hkv, Nq, Nk, D, bm, bn, p["dtype"], p["causal"], tensor_cores=True),
        smem_bytes=kernel.fa3_smem,
        threads=kernel.fa3_threads,
        blocks=-(-Nq // bm) * H * B,
        num_splits=1,
    )
    del o
    if not problem["sim"]:
        from numba_flash.research.profiling.resources import compiled_resources

        ms = median_ms(run, warmup=warmup, repeats=repeats)
        row.update(ms=ms, tflops=tflops(problem["flops"], ms))
        row.update(compiled_resources(kernel, kernel.fa3_threads, kernel.fa3_smem).as_dict())
    return row


def _backward(problem, algorithm, o, lse, repeats, warmup) -> dict:
    """The backward fields of a kernel's row: ``attention_backward`` (``algorithm``'s loop order)
    of the forward's ``o`` and ``lse``, its gradients checked against float64 and, on a GPU, timed."""
    from numba_flash.backward import attention_backward

    p, q, k, v = problem["p"], problem["q"], problem["k"], problem["v"]
    do = upstream_gradient(problem)

    def run():
        return attention_backward(do, q, k, v, o, lse, causal=p["causal"], algorithm=algorithm)

    fields = dict(_gradient_errors(run(), problem))
    if not problem["sim"]:
        ms = median_ms(run, warmup=warmup, repeats=repeats)
        fields.update(bwd_ms=ms, bwd_tflops=tflops(BACKWARD_FLOPS * problem["flops"], ms))
    return fields


def upstream_gradient(problem):
    """The incoming gradient ``dO`` of the problem's backward: standard normal, q's shape, dtype
    and library, from the problem's own seed stream; made on first use and kept in ``problem``."""
    if problem.get("do") is None:
        q = problem["q"]
        rng = np.random.default_rng(problem.get("seed", 0) + 1)
        host = rng.standard_normal(tuple(q.shape), dtype=np.float32)
        if problem["sim"]:
            problem["do"] = host.astype(q.dtype)
        elif hasattr(q, "double"):  # torch (bfloat16)
            import torch

            problem["do"] = torch.as_tensor(host, device="cuda").to(q.dtype)
        else:
            problem["do"] = sys.modules["cupy"].asarray(host).astype(q.dtype)
    return problem["do"]


def gradient_scope(batch: int, heads: int, kv_heads: int, n_q: int, n_k: int, budget: int = GRAD_REF_BUDGET_BYTES):
    """Which gradients the float64 reference checks: ``(query heads, kv heads, label)`` index
    pairs ``(batch slice, head slice)``, or ``None`` when not even one group fits ``budget``.

    All of them when the float64 scores of every head fit; else batch 0, kv head 0 and its query
    heads (dK and dV of a kv head sum over all its query heads' rows, so no fewer rows will do)."""
    group = heads // kv_heads
    if batch * heads * n_q * n_k * 8 <= budget:
        return (slice(None), slice(None)), (slice(None), slice(None)), "all"
    if group * n_q * n_k * 8 <= budget:
        return (slice(0, 1), slice(0, group)), (slice(0, 1), slice(0, 1)), "batch 0, kv head 0"
    return None


def _gradient_errors(grads, problem) -> dict:
    """The largest relative (Frobenius) error of dq, dk, dv against ``reference.attention_backward``
    on :func:`gradient_scope`'s part, and that part's label."""
    from numba_flash import reference

    p = problem["p"]
    scope = gradient_scope(p["batch"], p["heads"], p["kv_heads"], p["seq"], p["seq_k"])
    if scope is None:
        return dict(grad_rel_err_scope="not checked: the float64 scores of one kv head's group exceed "
                                       f"{GRAD_REF_BUDGET_BYTES / 1e9:.0f} GB")
    q_part, kv_part, label = scope
    q, k, v, do = problem["q"][q_part], problem["k"][kv_part], problem["v"][kv_part], upstream_gradient(problem)[q_part]
    refs = reference.attention_backward(do, q, k, v, causal=p["causal"])
    worst = 0.0
    for got, part, ref in zip(grads, (q_part, kv_part, kv_part), refs):
        diff = reference.to_numpy(got[part], "gradient") - ref
        worst = max(worst, float(np.linalg.norm(diff) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny)))
    return dict(grad_rel_err=worst, grad_rel_err_scope=label)


def _peer_backward_call(problem, name: str):
    """A zero-argument backward of PyTorch peer ``name``: ``torch.autograd.grad`` of its SDPA output
    for the problem's upstream gradient (the forward graph built once, kept)."""
    import torch

    from numba_flash.baselines import torch_sdpa_backends

    p = problem["p"]
    backends = torch_sdpa_backends(p["dtype"])
    if name not in backends:
        raise ValueError(f"no peer {name!r} for {p['dtype']} here")
    inputs = [(x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)).detach().requires_grad_()
              for x in (problem["q"], problem["k"], problem["v"])]
    do = upstream_gradient(problem)
    do = do if isinstance(do, torch.Tensor) else torch.from_dlpack(do)
    out = backends[name](*inputs, p["causal"])
    return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)


def _errors(o, problem) -> dict:
    """Max absolute and relative (Frobenius) error of ``o`` against the reference, on the part checked."""
    ref_o = reference_output(problem)
    diff = _float64(o[problem["checked"]]) - ref_o
    return dict(max_abs_err=float(abs(diff).max()), rel_err=_norm(diff) / _norm(ref_o),
                rel_err_scope=problem["rel_err_scope"])


def _peer_call(problem, name: str):
    """A zero-argument call of peer ``name`` on the problem's inputs."""
    from numba_flash.baselines import cupy_attention, torch_sdpa_backends

    q, k, v, p = problem["q"], problem["k"], problem["v"], problem["p"]
    if name == "cupy":
        return lambda: cupy_attention(q, k, v, causal=p["causal"])
    backends = torch_sdpa_backends(p["dtype"])
    if name not in backends:
        raise ValueError(f"no peer {name!r} for {p['dtype']} here (torch SDPA backends: {', '.join(backends) or 'none'})")
    return lambda: backends[name](q, k, v, p["causal"])


def _extra_device_bytes(fn) -> int:
    """Bytes one call of the kernel ``fn`` takes from CuPy's pool beyond its inputs and its o.

    Read while the call's results are still held: FA-2 allocates o and the logsumexp and
    frees nothing, so this is its peak. (Allocations outside CuPy's pool, by numba, are
    not seen; FA-2 makes none once warm.)
    """
    import cupy as cp

    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    o, _ = fn()
    cp.cuda.Device().synchronize()
    return pool.used_bytes() - before - o.nbytes


def numpy_dtype(name: str):
    """The NumPy dtype of a dtype name (bfloat16: ``ml_dtypes.bfloat16``)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _float64(x):
    """A NumPy, CuPy or torch array in float64."""
    return x.double() if hasattr(x, "double") else x.astype(np.float64)


def _norm(x) -> float:
    """Frobenius norm of a float64 NumPy, CuPy or torch array."""
    if hasattr(x, "double"):  # torch
        return float(x.norm())
    xp = np if isinstance(x, np.ndarray) else sys.modules["cupy"]
    return float(xp.linalg.norm(x.ravel()))

"""The bridge in a loop whose T changes every call (docs/design.md §9), next to fixed-T and JAX loops.

    python -m benchmarks.varying_t [--out DIR] [--vocab 18992] [--calls 40] [--max-tokens 32768]

One vocabulary shard (V_loc = 18,992: TP = 8 of Qwen's 151,936), bf16 logits owned by torch,
entropy with its gradient, T uniform in [1, max-tokens]. Reports ms per forward+backward
call, each a median-free mean over the whole sequence (device-synchronised at its ends):
  * the bridge over the sequence: first pass (compiles included), the same sequence again,
    and a new sequence (a few window sizes may still be new), with the programs compiled
    in each;
  * the bridge at a fixed T = 16,384 (about the mean T);
  * JAX on the same sequence with each T compiled beforehand (exact shapes, no windows):
    the device-time floor of the sequence plus JAX's own dispatch.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import bridge  # noqa: E402  first: JAX must start without preallocating
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import jaxops  # noqa: E402
from benchmarks import harness  # noqa: E402
from bridge import _jaxfns, _windows  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--vocab", type=int, default=18_992)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32_768)
    parser.add_argument("--fixed-tokens", type=int, default=16_384)
    args = parser.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    V, t_max = args.vocab, args.max_tokens
    big = torch.randn(t_max, V, device=dev, dtype=torch.bfloat16) * 3
    targets = torch.randint(0, V, (t_max,), device=dev)
    cot = torch.randn(t_max, device=dev)

    def bridge_pass(sizes):
        compiled = _jaxfns.compiled_programs()
        sync()
        start = time.perf_counter()
        for T in sizes:
            x = big[:T].detach().requires_grad_()  # a zero-copy row slice of torch's memory
            lp, h = bridge.logprob_entropy(x, targets[:T])
            torch.autograd.grad([lp, h], [x], [cot[:T], cot[:T]])
        sync()
        ms = (time.perf_counter() - start) / len(sizes) * 1e3
        return ms, _jaxfns.compiled_programs() - compiled

    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(1, t_max + 1, (args.calls,), generator=gen).tolist()
    new_seq = torch.randint(1, t_max + 1, (args.calls,), generator=gen).tolist()
    results = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "vocab": V, "dtype": "bfloat16", "entropy": True, "calls": args.calls,
               "max_tokens": t_max, "mean_tokens": sum(seq) / len(seq),
               "windows_per_call_mean": sum(len(_windows.row_windows(T)) for T in seq) / len(seq),
               "extra_rows_share": sum(sum(w.size for w in _windows.row_windows(T)) - T
                                       for T in seq) / sum(seq)}
    for name, sizes in (("bridge_first_pass", seq), ("bridge_same_sequence", seq),
                        ("bridge_new_sequence", new_seq),
                        ("bridge_fixed_T", [args.fixed_tokens] * args.calls)):
        ms, compiled = bridge_pass(sizes)
        results[name] = {"ms_per_call": ms, "programs_compiled": compiled}
        print(f"{name:24s} {ms:9.3f} ms/call  {compiled:3d} programs compiled", flush=True)

    # JAX, each T compiled before timing (exact shapes): the floor without windows
    jx = jnp.asarray(big.float().cpu().numpy()).astype(jnp.bfloat16)
    jy = jnp.asarray(targets.cpu().numpy()).astype(jnp.int32)
    jg = jnp.asarray(cot.cpu().numpy())

    @jax.jit
    def fwd_bwd(x, y, g):
        _, vjp = jax.vjp(lambda z: jaxops.logprob_entropy(z, y), x)
        return vjp((g, g))[0]

    inputs = {T: (jx[:T], jy[:T], jg[:T]) for T in set(seq)}
    for T in inputs:
        harness.block_jax(fwd_bwd(*inputs[T]))
    start = time.perf_counter()
    for T in seq:
        out = fwd_bwd(*inputs[T])
    harness.block_jax(out)
    ms = (time.perf_counter() - start) / len(seq) * 1e3
    results["jax_exact_shapes_precompiled"] = {"ms_per_call": ms}
    print(f"{'jax_exact_shapes':24s} {ms:9.3f} ms/call  (each T compiled beforehand)")
    results["sequence"] = seq
    path = os.path.join(args.out, "varying_t.json")
    harness.write_json(path, results)
    print("wrote", path)


if __name__ == "__main__":
    main()

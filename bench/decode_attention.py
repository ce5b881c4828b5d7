"""Decode attention alone, at the built-in engine's CPU shape, against the time it takes to read its keys and
values.

    python -m bench.decode_attention [--sequences 64] [--width 224] [--visible 215] [--layers 30]
                                     [--threads 2]
    python -m bench.decode_attention --native      # also a C++ probe kernel, built on the spot (about 30 s)

One decode step's attention for `--layers` layers, each over its own cache (as in the engine, every layer's
keys and values come from memory, not from the CPU's caches): `--sequences` sequences of SmolLM2-135M's heads
(3 kv heads, 3 query heads each, head_dim 64; `--kv-heads`, `--group`, `--head-dim`), the cache `--width`
positions wide, up to `--visible` of them attended (sequences end 0-20 positions apart). It times, in
alternating rounds, the medians:
- `read`: summing the keys and the values, the least time their bytes allow at this thread count;
- `matmuls`: the engine's CPU path (engines/llama.py `two_matmul_attention`: two batched matmuls, a float32
  softmax);
- `fused`: `F.scaled_dot_product_attention` with the mask, the engine's path where the split does not pay;
- with `--native`, a probe: a C++ loop (below) that reads each (sequence, kv head) block once, only its
  visible positions, with float32 scores, softmax and sums. The engine does not use it; it measures what a
  kernel of that kind gains before anyone builds one in (a compiler, a build on first use, a second path to
  keep exact).
Prints each time a layer, the matmuls' and the probe's largest distance from a float64 reference, and ends
with `matmuls_vs_read=<ratio>` (and `native_vs_matmuls=<ratio>`: above 1 the probe is faster).
"""
import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from engines.llama import two_matmul_attention

PROBE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

static inline float widen(uint16_t x) {  // bf16 bits -> float32
  uint32_t bits = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// q [n, KV, G, D], keys/values [n, KV, W, D] (bf16, contiguous), visible [n] -> [n, KV, G, D] bf16
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor visible, double scale) {
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "contiguous bf16 tensors only");
  const int64_t n = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3), W = keys.size(2);
  auto out = torch::empty_like(q);
  auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  auto* lp = visible.data_ptr<int64_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), s(G * W), acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t len = lp[item / KV];
      for (int64_t i = 0; i < G * D; ++i) qf[i] = widen(qp[item * G * D + i]) * (float)scale;
      const uint16_t* k = kp + item * W * D;
      for (int64_t t = 0; t < len; ++t)
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          #pragma omp simd reduction(+:dot)
          for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * widen(k[t * D + d]);
          s[g * W + t] = dot;
        }
      for (int64_t g = 0; g < G; ++g) {
        float* row = s.data() + g * W;
        float peak = -INFINITY, sum = 0.f;
        #pragma omp simd reduction(max:peak)
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, row[t]);
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; ++t) { row[t] = expf(row[t] - peak); sum += row[t]; }
        for (int64_t t = 0; t < len; ++t) row[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const uint16_t* v = vp + item * W * D;
      for (int64_t t = 0; t < len; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * W + t];
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * widen(v[t * D + d]);
        }
      for (int64_t i = 0; i < G * D; ++i) op[item * G * D + i] = static_cast<at::BFloat16>(acc[i]);
    }
  });
  return out;
}
"""  # noqa: E501


def build_probe():
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("ringrl_decode_attention_probe", cpp_sources=PROBE, functions=["attend"],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"])
    except Exception as error:  # no compiler, no ninja, a compile error: one line that names the fix
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        sys.exit(f"error: --native could not build the probe ({reason}); it needs a C++ compiler with OpenMP "
                 "and ninja (pip install ninja); run without --native for the rest")


def measure(args) -> tuple[dict[str, float], dict[str, float]]:
    """(µs a layer, largest distance from a float64 reference) for each way, the medians of `args.rounds`
    rounds."""
    torch.manual_seed(0)
    n, kv, g, d, width = args.sequences, args.kv_heads, args.group, args.head_dim, args.width
    keys = torch.randn(args.layers, n, kv, width, d).bfloat16()
    values = torch.randn(args.layers, n, kv, width, d).bfloat16()
    q = torch.randn(n, kv, g, d).bfloat16()
    visible_len = args.visible - torch.randint(0, 21, (n,))
    visible = (torch.arange(width)[None, :] < visible_len[:, None])[:, None, None, :]
    split = two_matmul_attention(visible, d)
    ways = {"read": lambda i: (keys[i].sum(), values[i].sum()),
            "matmuls": lambda i: split(q, keys[i], values[i]),
            "fused": lambda i: F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=visible)}
    if args.native:
        probe = build_probe()
        ways["native"] = lambda i: probe.attend(q, keys[i], values[i], visible_len, d ** -0.5)
    scores = (q.double() @ keys[0].double().transpose(-1, -2)) * d ** -0.5
    reference = scores.masked_fill(~visible, -math.inf).softmax(-1) @ values[0].double()
    errors = {name: (way(0).double() - reference).abs().max().item()
              for name, way in ways.items() if name != "read"}
    seconds = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            for i in range(args.layers):
                way(i)
            seconds[name].append((time.perf_counter() - start) / args.layers)
    return {name: statistics.median(s) * 1e6 for name, s in seconds.items()}, errors


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--width", type=int, default=224, help="cache positions (the engine reads them all)")
    parser.add_argument("--visible", type=int, default=215, help="positions the longest sequence attends to")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads a kv head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--native", action="store_true", help="also build and time the C++ probe")
    args = parser.parse_args(argv)
    if not 20 < args.visible <= args.width:
        parser.error("--visible must be more than 20 and at most --width")
    torch.set_num_threads(args.threads)
    us, errors = measure(args)
    # a layer's keys and values, bf16
    size = 2 * args.sequences * args.kv_heads * args.width * args.head_dim * 2
    print(f"decode attention: {args.sequences} sequences x {args.kv_heads} kv heads x {args.group} query "
          f"rows, head_dim {args.head_dim}, {args.width} positions wide (up to {args.visible} visible), "
          f"bf16, {args.threads} threads; a layer, the median of {args.rounds} rounds over "
          f"{args.layers} layers' caches:")
    for name, time_us in us.items():
        error = f", at most {errors[name]:.1e} from float64" if name in errors else ""
        print(f"  {name:8s} {time_us:7.0f} us (the cache's keys and values over it: "
              f"{size / time_us / 1e3:.1f} GB/s{error})")
    print(f"matmuls_vs_read={us['matmuls'] / us['read']:.2f}")
    if args.native:
        print(f"native_vs_matmuls={us['matmuls'] / us['native']:.2f}")
    return us, errors


if __name__ == "__main__":
    main()

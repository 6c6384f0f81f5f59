"""Peak memory and speed of model.token_logprobs (chunked head + checkpointing) against the
naive full log-softmax, forward + backward, on a small random Llama with a real-sized vocab.

    python bench/logprobs_bench.py                       # vocab 49152 (SmolLM2) and 151936 (Qwen2.5)
    python bench/logprobs_bench.py --batch 4 --seq 1024 --vocab 151936

Each (vocab, variant) runs in a fresh subprocess. Peak memory = the kernel's resident-set high-water
mark (VmHWM, reset through /proc/self/clear_refs just before the measured call) minus the resident
set just before it; torch's CPU allocator keeps no statistics and tracemalloc cannot see it.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402
from infra import packing  # noqa: E402
from infra import system as S  # noqa: E402


def naive_logprobs(m, ids, mask, start, temperature, with_entropy):
    """What a straightforward implementation does: [B, L, V] logits and an fp32 log-softmax over all of it."""
    logits = m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, start - 1:-1].float() / temperature, dim=-1)  # [B, R, V]
    token = logp.gather(-1, ids[:, start:, None]).squeeze(-1)  # [B, R]
    return (token, -(logp.exp() * logp).sum(-1)) if with_entropy else token


def proc_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = args.vocab[0]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                         num_key_value_heads=max(1, args.hidden // 64), tie_word_embeddings=True)
    m = LlamaForCausalLM(config).train()
    ids = torch.randint(0, vocab, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    mask[0, :args.prompt // 2] = 0  # one left-padded prompt
    start = args.prompt

    def run():
        if args.variant == "chunked":
            out = M.token_logprobs(m, packing.from_padded(ids, mask, start), 0.7, args.entropy,
                                   chunk_size=args.chunk_size)
        else:
            out = naive_logprobs(m, ids, mask, start, 0.7, args.entropy)
        loss = out[0].sum() + 0.001 * out[1].sum() if args.entropy else out.sum()  # PPO also needs entropy
        loss.backward()

    times, cpu_times, peak_kib = [], [], None
    for rep in range(args.reps):
        m.zero_grad(set_to_none=True)
        before = proc_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
            reset = True
        except OSError:
            reset = False
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)  # steadier than wall time on a shared machine
        if rep == 0:
            peak_kib = (proc_kib("VmHWM") if reset else S.peak_rss_gb() * 2**20) - before
    print(json.dumps({"peak_mib": peak_kib / 1024, "seconds": min(times), "cpu_seconds": min(cpu_times), "hwm_reset": reset}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936], help="vocabulary sizes")
    parser.add_argument("--batch", type=int, default=4, help="rows")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row (prompt + response)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the random model")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the random model")
    parser.add_argument("--chunk-size", type=int, default=256, help="token_logprobs chunk_size (B*R/chunk chunks)")
    parser.add_argument("--entropy", action="store_true", help="also compute the entropy and add it to the loss")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions (min is reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return worker(args)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("vocab", "variant", "entropy")]
    flags += ["--entropy"] * args.entropy
    print(f"B={args.batch} L={args.seq} R={args.seq - args.prompt} hidden={args.hidden} layers={args.layers} "
          f"chunk={args.chunk_size} threads={args.threads} entropy={args.entropy}, forward+backward, fp32")
    print(f"{'vocab':>7} {'naive MiB':>10} {'chunked MiB':>12} {'mem ratio':>10} {'naive s':>8} {'chunked s':>10} "
          f"{'time ratio':>10} {'cpu-time ratio':>14}")
    for vocab in args.vocab:
        res = {}
        for variant in ("naive", "chunked"):
            out = subprocess.run([sys.executable, __file__, f"--vocab={vocab}", f"--variant={variant}", *flags],
                                 capture_output=True, text=True, check=True)
            res[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        n, c = res["naive"], res["chunked"]
        print(f"{vocab:>7} {n['peak_mib']:>10.0f} {c['peak_mib']:>12.0f} {n['peak_mib'] / c['peak_mib']:>9.1f}x "
              f"{n['seconds']:>8.2f} {c['seconds']:>10.2f} {c['seconds'] / n['seconds']:>9.2f}x "
              f"{c['cpu_seconds'] / n['cpu_seconds']:>13.2f}x")
        if not (n["hwm_reset"] and c["hwm_reset"]):
            print("  (VmHWM could not be reset: peaks are ru_maxrss deltas, less precise)")


if __name__ == "__main__":
    main()

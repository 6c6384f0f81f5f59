"""Signal-to-exit time of train.py under SIGTERM at several points of a step, on the demo's configuration.

    python bench/preempt_bench.py -- $(make -s print-demo-args)      # or any train.py flags after --
    python bench/preempt_bench.py --shape qwen2.5-0.5b --points rollout -- $(make -s print-demo-args)

Each point runs train.py (through tests/_fault_worker.py, which sends the SIGTERM from inside the phase) for two
steps with the signal in step 2, and prints the seconds from the signal to the process's exit, the exit code, what
the run said it kept, and the checkpoint's size and write time (its disk bandwidth). torchrun and SLURM allow 30 s
before SIGKILL; --shutdown-grace (20 s) bounds ours. --shape trains a random model of a real model's shape instead
of --model (SHAPES; SmolLM2's tokenizer, the embedding as large as the real one's).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the demo: grpo (no separate old log-prob pass), 24 trajectories, 3 micro-batches of 8, one mini-batch
POINTS = {"rollout": "term-rollout:2", "log-probs": "term-logprobs:2:*:2", "update-first-micro":
          "term-update:2:*:1", "update-last-micro": "term-update:2:*:3", "validation": "term-validate:2"}
# model.make_tiny's arguments for real models' shapes (Qwen2.5-0.5B: 494M parameters, tied embedding)
SHAPES = {"qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default=",".join(POINTS), help="comma-separated: " + ", ".join(POINTS))
    p.add_argument("--shape", choices=SHAPES, default=None, help="a random model of this shape as --model")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py flags after --")
    args = p.parse_args()
    flags = [a for a in args.train_args if a != "--"]
    if args.shape:
        sys.path.insert(0, str(ROOT))
        import model


        path = Path(tempfile.gettempdir()) / f"mutis-random-{args.shape}"
        if not (path / "config.json").exists():
            model.make_tiny(path, **SHAPES[args.shape])
        flags += ["--model", str(path)]
    rows = []
    for name in args.points.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            clock = Path(tmp) / "signal_time"
            cmd = [sys.executable, str(ROOT / "tests" / "_fault_worker.py"), POINTS[name], *flags, "--steps", "2",
                   "--val-freq", "2", "--no-val-before-train", "--out", f"{tmp}/out"]
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "FAULT_TIME_FILE": str(clock)},
                                  capture_output=True, text=True)
            end = time.time()
            took = end - float(clock.read_text()) if clock.exists() else float("nan")
            said = next((line for line in proc.stdout.splitlines() if line.startswith("[signal]")),
                        next((line for line in proc.stderr.splitlines() if line.startswith("error:")), "-"))
            ckpt = next((line for line in proc.stdout.splitlines() if line.startswith("[ckpt]")), None)
            written = ""
            if ckpt and (steps := sorted(Path(tmp, "out").glob("step_[0-9]*[0-9]"))):
                size = sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file()) / 1e9
                secs = float(ckpt.rsplit("(", 1)[1].split("s")[0])
                written = f"  checkpoint {size:.2f} GB in {secs:.1f} s ({size / secs:.2f} GB/s)"
            rows.append((name, took, proc.returncode, said.split("): ", 1)[-1]))
            print(f"{name:28} {took:6.1f} s  exit {proc.returncode}  {rows[-1][3]}{written}", flush=True)
            if proc.returncode != 143:
                print(proc.stderr[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()

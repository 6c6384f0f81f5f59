"""eval.py on a rank whose clock reads another hour than rank 0's (TZ): ranks that name --out's default each from
their own clock write to different directories (tests/test_eval_scale.py)."""
import os
import runpy
import sys
import time
from pathlib import Path

if os.environ.get("RANK") == "1":
    os.environ["TZ"] = "Etc/GMT+5"
    time.tzset()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.argv = [str(ROOT / "eval.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")

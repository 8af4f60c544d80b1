"""What scripts/gpu_check.sh runs instead of a phase in a dry run (GPU_CHECK_DRY=1):
the phase's outputs, marked dry, after ``seconds`` (forever when ``hang``)."""

import json
import sys
import time

phase, d, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
hang = sys.argv[4] == phase
if phase == "timing":  # rows as they come, like bench/gpu_timing.py --jsonl
    for i in range(3):
        time.sleep(secs / 3)
        if hang and i == 1:  # one row written, then stuck
            time.sleep(3600)
        with open(f"{d}/timing.jsonl", "a") as f:
            row = {"op": f"dry_op_{i}", "backend": "stub", "ms": 1.0, "dry": True}
            f.write(json.dumps(row) + "\n")
    with open(f"{d}/timing.json", "w") as f:
        json.dump({"device": "DRY", "rows": [], "failed": []}, f)
elif hang:
    time.sleep(3600)
elif phase in ("triton", "cutlass", "cuda", "full"):
    time.sleep(secs)
    name = {"cuda": "gpu"}.get(phase, phase)
    with open(f"{d}/junit_{name}.xml", "w") as f:
        f.write(
            f'<testsuites><testsuite name="dry"><testcase classname="dry.{phase}" '
            f'name="test_stub" time="{secs}"/></testsuite></testsuites>\n'
        )
elif phase == "facts":
    time.sleep(secs)
    with open(f"{d}/facts.json", "w") as f:
        json.dump({"gpu": "DRY (no GPU: phases stubbed)", "dry": True}, f)
else:
    time.sleep(secs)
print(f"dry stub of {phase}: {secs} s")

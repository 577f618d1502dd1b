"""Peak host memory of saving one rank's shard: save_sharded's streaming vs writers that hold it all.

    .venv/bin/python benchmarks/checkpoint_memory.py [--shard-mb 512] [--tensors 16]

Each row runs in a fresh process: it makes one rank's shard (``--tensors`` float32 DTensors
over a gloo world of 1, so ``to_local()`` is the whole tensor, as on the rank of a larger world),
resets the kernel's peak resident set (``/proc/self/clear_refs``), saves, and reports the peak
resident set growth during the save (``VmHWM`` after minus ``VmRSS`` before; ``floor`` is
``VmHWM - VmRSS`` right after the reset, about 0). Written file pages sit in the page cache,
which is not resident set, so the growth is what the writer itself held. Two layouts:

* contiguous: the tensors are on host memory already, as a CPU run's shards are;
* strided: every tensor is a transposed view, so each writer must copy before writing (as it must
  copy a GPU shard to the host): ``save_file`` / ``save_state`` copy every tensor first, while
  ``save_sharded`` copies one bucket at a time.

Baselines: ``safetensors.torch.save_file`` of the same local tensors (one file, every tensor at
once) and ``gymbridge.safe_io.save_state`` (the whole file built in memory, then written).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ["save_sharded:4", "save_sharded:64", "save_sharded:256", "save_file", "save_state"]
LAYOUTS = ["contiguous", "strided"]


def _status_mib(field: str) -> float:
    """``VmRSS`` (resident set) or ``VmHWM`` (its peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    """Make ``VmHWM`` the current resident set (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child(method: str, layout: str, shard_mb: int, n_tensors: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gymbridge.safe_io import save_state
    from gymbridge.trainer.sharded_checkpoint import save_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    cols = 1024
    rows = max(1, shard_mb * 2**20 // (4 * cols * n_tensors))
    tensors = {}
    for i in range(n_tensors):
        local = torch.randn(rows, cols) if layout == "contiguous" else torch.randn(cols, rows).t()
        tensors[f"layer.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    shard_mib = sum(t.to_local().numel() * 4 for t in tensors.values()) / 2**20
    _reset_peak_rss()
    rss_before = _status_mib("VmRSS")
    floor_mib = _status_mib("VmHWM") - rss_before  # about 0 when the reset worked
    start = time.perf_counter()
    if method.startswith("save_sharded"):
        bucket = float(method.split(":")[1])
        save_sharded(out / "ckpt", tensors, {}, rank=0, world_size=1, bucket_mb=bucket)
    else:
        local = {k: v.to_local() for k, v in tensors.items()}
        if method == "save_file":
            save_file({k: v.contiguous() for k, v in local.items()}, str(out / "ckpt.safetensors"))
        else:
            save_state(out / "ckpt.state", local, {})
    seconds = time.perf_counter() - start
    peak_mib = _status_mib("VmHWM")
    print(f"{shard_mib:.1f} {floor_mib:.1f} {peak_mib - rss_before:.1f} {seconds:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-mb", type=int, default=512, help="size of the rank's shard in MiB")
    parser.add_argument("--tensors", type=int, default=16, help="how many tensors the shard holds")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "LAYOUT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, layout, out = args.child
        _child(method, layout, args.shard_mb, args.tensors, Path(out))
        return
    print(f"one rank's shard of {args.shard_mb} MiB in {args.tensors} float32 tensors; peak RSS growth")
    columns = f"{'shard MiB':>9} {'growth MiB':>10} {'growth/shard':>12} {'s':>7} {'floor MiB':>10}"
    print(f"{'layout':<11} {'writer':<28} {columns}")
    for layout in LAYOUTS:
        for method in METHODS:
            out = Path(tempfile.mkdtemp(prefix="ckpt-mem-"))
            try:
                cmd = [
                    sys.executable,
                    __file__,
                    "--shard-mb",
                    str(args.shard_mb),
                    "--tensors",
                    str(args.tensors),
                ]
                result = subprocess.run(
                    [*cmd, "--child", method, layout, str(out)], capture_output=True, text=True, check=True
                )
            finally:
                shutil.rmtree(out, ignore_errors=True)
            shard, floor, growth, seconds = (float(x) for x in result.stdout.split()[-4:])
            label = method.replace(":", " bucket=") + (" MiB" if ":" in method else "")
            ratio = growth / shard
            row = f"{layout:<11} {label:<28} {shard:>9.0f} {growth:>10.1f} {ratio:>12.3f} {seconds:>7.2f}"
            print(f"{row} {floor:>10.1f}")


if __name__ == "__main__":
    main()

"""Screenshots of TensorBoard's scalars, images and hparams dashboards for docs/tensorboard.md, taken with headless
Chromium (Debian's ``chromium``: ``apt-get install chromium``) on TensorBoard served on 127.0.0.1.

    python scripts/tensorboard_screenshots.py [--out docs/figures]

It trains two short runs with the project's CLI in a temporary folder: ResNet-18 on the real CIFAR-10 subset beside
the project (``MULTIGPU_CIFAR10_SUBSET``, or ``../shared/data/cifar10-subset``; synthetic images where there is
none), one with batches of 32 and one with batches of 64, so that HPARAMS has two rows. It then serves their logs
with TensorBoard on a free port, writes ``tensorboard-scalars.png``, ``tensorboard-images.png`` and
``tensorboard-hparams.png`` to ``--out``, stops TensorBoard and removes the folder. The training takes about
1.5 minutes on 2 idle CPU cores. ``--logdir DIR`` takes the screenshots of logs that exist instead of training.
"""

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBSET = Path(os.environ.get("MULTIGPU_CIFAR10_SUBSET", REPO.parent / "shared" / "data" / "cifar10-subset"))

# Each run: its name and the options that set it apart: the same 1,920 images an epoch in 60 steps of 32 or 30 of
# 64 (the learning rate scales with the batch), validated twice an epoch.
RUNS = {
    "batch-32": ["--data.batch_size=32", "--trainer.limit_train_batches=60", "--trainer.val_check_interval=30"],
    "batch-64": ["--data.batch_size=64", "--trainer.limit_train_batches=30", "--trainer.val_check_interval=15"],
}
FIRST = next(iter(RUNS))  # the images dashboard shows its images only
# Short and still learning on a CPU: ResNet-18 with torchvision's stem (the 32x32 images shrink to 8x8 at once),
# 3 epochs, logged every 5 steps.
TRAINING = [
    "--model.arch=resnet18",
    "--model.stem=imagenet",
    "--model.base_lr=0.1",
    "--model.warmup_epochs=0.5",
    "--trainer.max_epochs=3",
    "--trainer.log_every_n_steps=5",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]
SCALARS = r"^(train/(loss|grad_norm)|val/acc|perf/step/(data_wait_share|images_per_s|seconds))$"  # 6 charts in 3 rows


def fragment(dashboard: str, **state: str) -> str:
    """A dashboard's address after the #, with its state as TensorBoard reads it there."""
    return "&".join([dashboard, *(f"{name}={urllib.parse.quote(value, safe='')}" for name, value in state.items())])


# Each screenshot: its file, its dashboard (raw values on the scalars' curves, the first run's images) and the
# window's size.
SHOTS = {
    "tensorboard-scalars.png": (fragment("scalars", _smoothingWeight="0", tagFilter=SCALARS), "1400,1140"),
    "tensorboard-images.png": (fragment("images", regexInput=f"^{FIRST}/"), "1400,760"),
    "tensorboard-hparams.png": (fragment("hparams"), "2300,330"),  # 5 hyperparameters and the 4 metrics side by side
}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=15000",
]


def fail(message: str) -> None:
    sys.exit(f"tensorboard_screenshots: {message}")


def shown(command: list[str]) -> str:
    """``command`` as a shell line, with ``python`` for this interpreter."""
    return shlex.join("python" if word == sys.executable else word for word in command)


def train(logs: Path, checkpoints: Path) -> None:
    """The runs of ``RUNS``, one after the other, with the project's CLI."""
    if (SUBSET / "cifar-10-batches-py").is_dir():
        data = ["--config", "configs/subset.yaml", f"--data.data_dir={SUBSET}"]
    else:
        print(f"no CIFAR-10 subset in {SUBSET}: synthetic images (set MULTIGPU_CIFAR10_SUBSET)")
        data = ["--config", "configs/smoke.yaml", "--data.synthetic_size=1920", "--trainer.accelerator=auto"]
    for name, options in RUNS.items():
        command = [sys.executable, "main.py", "fit", *data, *TRAINING, *options, f"--run_name={name}"]
        command += [f"--trainer.default_root_dir={logs}", f"--checkpoint_root={checkpoints}"]
        print(shown(command), flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
            fail(f"the run {name} failed (exit {done.returncode})")
        print(f"  {time.perf_counter() - started:.0f} s", flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_tensorboard(server: subprocess.Popen, url: str, runs: int, log: Path) -> None:
    """Until TensorBoard lists ``val/acc`` for ``runs`` runs, the same twice a second apart (it reads the logs in the
    background)."""
    deadline, before = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            print(log.read_text()[-3000:], file=sys.stderr)
            fail(f"tensorboard ended with exit {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/data/plugin/scalars/tags", timeout=5) as answer:
                tags = json.load(answer)
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            tags = None
        if tags and tags == before and sum("val/acc" in run_tags for run_tags in tags.values()) >= runs:
            return
        before = tags
        time.sleep(1)
    print(log.read_text()[-3000:], file=sys.stderr)
    fail(f"tensorboard at {url} did not list val/acc for {runs} runs within 120 s")


def screenshot(chromium: str, url: str, path: Path, size: str) -> None:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"]
        command += [f"--screenshot={path}", url]
        print(shown(command).replace(profile, "$(mktemp -d)"), flush=True)
        path.unlink(missing_ok=True)
        try:
            subprocess.run(command, capture_output=True, timeout=180)
        except subprocess.TimeoutExpired:
            fail(f"chromium took over 180 s on {url}")
    if not path.is_file() or path.stat().st_size == 0:
        fail(f"chromium wrote no screenshot of {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures", help="folder of the PNGs")
    parser.add_argument("--logdir", type=Path, help="screenshot these TensorBoard logs instead of training runs")
    args = parser.parse_args()
    if args.logdir is not None and not args.logdir.is_dir():
        fail(f"--logdir {args.logdir} is not a folder")
    chromium = shutil.which("chromium")
    if chromium is None:
        fail("chromium is not installed: apt-get install chromium")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="tensorboard-screenshots-"))
    server = None
    try:
        logs = args.logdir.resolve() if args.logdir else folder / "logs"
        if args.logdir is None:
            train(logs, folder / "checkpoints")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "tensorboard.main", f"--logdir={logs}", "--host=127.0.0.1", f"--port={port}"]
        print(shown(command), flush=True)
        log = folder / "tensorboard.log"
        with open(log, "w") as written:
            server = subprocess.Popen(command, stdout=written, stderr=subprocess.STDOUT)
        wait_for_tensorboard(server, url, 1 if args.logdir else len(RUNS), log)
        for name, (address, size) in SHOTS.items():
            screenshot(chromium, f"{url}/#{address}", out / name, size)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(folder, ignore_errors=True)
    for name in SHOTS:
        path = out / name
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()

"""What monitoring a busy run costs, and the dashboard's panels plotted from a real run.

    python benchmarks/monitoring.py [--follow-s 30] [--scrape-s 60] [--plot docs/monitoring-dashboard.png]

Starts the CPU default (``rlbus run``, its own exporter off) and, once it trains, ``rlbus exporter`` as a separate
process against the run's Redis. Phase 1: no scrapes, so the exporter's CPU is its stream follower alone. Phase 2:
Debian's Prometheus scrapes it every second; the extra CPU over phase 1, per scrape, is a scrape's cost, cross-checked
with the exporter's own ``rlbus_exporter_collect_cpu_seconds_total``. Beside them, the CPU of every process of the
run (its baseline). Then every dashboard panel is queried over phase 2 and drawn, one small plot per panel.
"""

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and benchmarks/bus.py shadows the `bus` package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from bus.clients import sync_client  # noqa: E402
from bus.keys import Keys  # noqa: E402
from workers.config import RlbusConfig  # noqa: E402
from workers.tools.exporter import RunCollector  # noqa: E402
from workers.tools.inspect_run import run_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TICK_S = 100.0  # os.sysconf("SC_CLK_TCK") on Linux


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += cpu_s(p)
        except OSError:
            pass
    return total


def get_json(url: str, **params) -> dict:
    with urllib.request.urlopen(url + ("?" + urllib.parse.urlencode(params) if params else ""), timeout=10) as r:
        return json.loads(r.read())


def wait_for(what: str, done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready after {timeout_s:.0f}s")
        time.sleep(0.5)


def exporter_value(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, flags=re.M).group(1))


def scrape_cpu_ms(url: str, run: str, n: int = 50) -> tuple[float, float]:
    """CPU ms of one scrape's collect and text encoding, in this process against the live run; beside it, of
    ``rlbus inspect``'s one-shot report (the same XINFO reads, no Prometheus)."""
    client = sync_client(url)
    collector = RunCollector(client, RlbusConfig.model_validate({"run": {"name": run}, "redis": {"url": url}}))
    registry = CollectorRegistry()
    registry.register(collector)
    collector.follower.poll()
    started = time.process_time()
    for _ in range(n):
        generate_latest(registry)
    scrape = (time.process_time() - started) / n * 1000
    started = time.process_time()
    for _ in range(n):
        run_report(client, Keys(run))
    inspect = (time.process_time() - started) / n * 1000
    client.close()
    return scrape, inspect


def plot_panels(prom_port: int, start: float, end: float, run: str, path: Path) -> int:
    panels = [p for p in json.loads((ROOT / "deploy/grafana/dashboards/rlbus.json").read_text())["panels"]
              if p["type"] != "row"]
    cols = 4
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(18, 3.2 * ((len(panels) + 3) // 4)))
    drawn = 0
    for ax, panel in zip(axes.flat, panels, strict=False):
        before = drawn
        for target in panel["targets"]:
            expr = target["expr"].replace("$run", run).replace("$__rate_interval", "15s")
            result = get_json(f"http://127.0.0.1:{prom_port}/api/v1/query_range", query=expr, start=start, end=end,
                              step=2)["data"]["result"]
            for series in result:
                label = re.sub(r"\{\{(\w+)\}\}", lambda m, s=series: s["metric"].get(m.group(1), ""),
                               target["legendFormat"])
                t = [float(x) - start for x, _ in series["values"]]
                ax.plot(t, [float(v) for _, v in series["values"]], label=label, linewidth=1)
                drawn += 1
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="best")
        if drawn == before:
            ax.text(0.5, 0.5, "no series in this run", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"rlbus dashboard panels, Prometheus query_range over a live CPU-default run ({end - start:.0f} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--follow-s", type=float, default=30.0, help="phase 1: exporter without scrapes")
    parser.add_argument("--scrape-s", type=float, default=60.0, help="phase 2: scraped every second")
    parser.add_argument("--plot", type=Path, help="write the dashboard's panels over phase 2 to this PNG")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlbus-monitoring-"))
    out, run = work / "run", "bench"
    exporter_port, prom_port, inference_port = free_port(), free_port(), free_port()
    log = open(work / "run.stdout", "w")
    run_proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "run", "@", str(ROOT / "configs/default.toml"), "--run.name", run,
         "--run.output_dir", str(out), "--model.path", str(work / "tiny"), "--inference.port", str(inference_port),
         "--run.max_steps", "100000", "--exporter.in_run", "false"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    procs = [run_proc]
    try:
        wait_for("the run's first steps", lambda: re.search(r"^step [3-9]\d*/", (work / "run.stdout").read_text(),
                                                             flags=re.M), 180)
        url = re.search(r'^url = "(.+)"$', (out / "config.resolved.toml").read_text(), flags=re.M).group(1)
        exporter = subprocess.Popen([sys.executable, "-m", "workers.cli", "exporter", "--run.name", run,
                                     "--redis.url", url, "--port", str(exporter_port)], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(exporter)
        wait_for("the exporter", lambda: _answers(f"http://127.0.0.1:{exporter_port}/metrics"), 30)
        time.sleep(3)  # its first read of the streams so far
        exp0, run0, t0 = cpu_s(exporter.pid), tree_cpu_s(run_proc.pid), time.monotonic()
        time.sleep(args.follow_s)
        exp1, run1, t1 = cpu_s(exporter.pid), tree_cpu_s(run_proc.pid), time.monotonic()
        config = work / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
            {"job_name": "rlbus", "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]},
            {"job_name": "rlbus-inference", "static_configs": [{"targets": [f"127.0.0.1:{inference_port}"]}]}]}))
        collect0 = exporter_value(exporter_port, "rlbus_exporter_collect_cpu_seconds_total")
        prom = subprocess.Popen(["/usr/bin/prometheus", f"--config.file={config}",
                                 f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(prom)
        wait_for("Prometheus", lambda: _answers(f"http://127.0.0.1:{prom_port}/-/ready"), 60)
        start, exp2, t2 = time.time(), cpu_s(exporter.pid), time.monotonic()
        time.sleep(args.scrape_s)
        end, exp3, t3 = time.time(), cpu_s(exporter.pid), time.monotonic()
        scrapes = float(get_json(f"http://127.0.0.1:{prom_port}/api/v1/query",
                                 query=f'count_over_time(up{{job="rlbus"}}[{int(args.scrape_s)}s])')["data"]["result"][0]["value"][1])
        collect1 = exporter_value(exporter_port, "rlbus_exporter_collect_cpu_seconds_total")
        follow_rate = (exp1 - exp0) / (t1 - t0)
        scraped_rate = (exp3 - exp2) / (t3 - t2)
        run_rate = (run1 - run0) / (t1 - t0)
        print(f"run (every process of `rlbus run`): {run_rate:.2f} CPU-s/s")
        print(f"exporter, following only:           {follow_rate * 1000:.1f} CPU-ms/s "
              f"({follow_rate / run_rate:.1%} of the run)")
        print(f"exporter, scraped every 1 s:        {scraped_rate * 1000:.1f} CPU-ms/s over {scrapes:.0f} scrapes")
        print("one scrape (process CPU delta):     "
              f"{(scraped_rate - follow_rate) * (t3 - t2) / scrapes * 1000:.1f} CPU-ms"
              " (noisy: the follower's share moves with the run's pace)")
        print(f"one scrape (its collect thread):    {(collect1 - collect0) / scrapes * 1000:.1f} CPU-ms")
        if args.plot:
            print(f"plotted {plot_panels(prom_port, start, end, run, args.plot)} series to {args.plot}")
        scrape, inspect = scrape_cpu_ms(url, run)
        print(f"one scrape in-process (collect + text): {scrape:.1f} CPU-ms; "
              f"bare baseline, `rlbus inspect`'s report: {inspect:.1f} CPU-ms")
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    main()

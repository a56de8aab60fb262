"""Does `plan`, given the link `bench link` measured, predict the cluster's own decode speed there?

On two network-namespace hosts (tests/cluster/netns.py; root), each sending through a tbf-shaped
link of --rate bits/s (0: the bare veth), a node agent per host; `moe-cluster bench link`
measures their link; `up` serves the demo model on them. Then, --rounds times: this machine's
compute is fitted (`bench decode --nodes 2 --transport envoy --keepalive none`, two node processes
here as the two hosts share its cores, then `plan --calibrate`), the measured link replaces the
collective that bench fitted over loopback, --requests completions of --tokens tokens are timed
on the cluster at once after, and `plan --calibration` predicts them: a shared machine's drift
falls on both alike. One JSON object out (docs/bench/link-check-*.json).

    sudo .venv/bin/python tests/cluster/link_check.py --rate 16000000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import netns  # noqa: E402
from cluster_fixture import cluster, http  # noqa: E402

SECRET = "link-check-secret"
PROMPT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."


ENV = dict(os.environ, MOE_CLUSTER_SECRET=SECRET, PYTHONUNBUFFERED="1")


def _cli(*args: str, json_out: bool = True):
    cmd = [sys.executable, "-m", "moe_cluster.coordinator.cli", *args]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed:\n{r.stderr}")
    return json.loads(r.stdout) if json_out else r.stdout


def _compute(tmp: Path, i: int, tokens: int) -> str:
    """This host's compute now: a bench decode of two node processes here, fitted by plan."""
    bench = _cli("bench", "decode", "--model", "demo", "--nodes", "2", "--transport", "envoy",
                 "--keepalive", "none", "--max-tokens", str(tokens), "--rounds", "2",
                 "--no-peers", "--json")  # fmt: skip
    (tmp / f"decode-{i}.json").write_text(json.dumps(bench))
    out = tmp / f"compute-{i}.json"
    _cli("plan", "--calibrate", str(tmp / f"decode-{i}.json"), "--out", str(out), json_out=False)
    return str(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=int, default=0, help="bits/s each host may send (0: unshaped)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="compute fits, each with its requests")
    p.add_argument("--requests", type=int, default=3, help="timed completions per round")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    from moe_cluster.coordinator.plan.calibration import read_calibration, write_calibration
    from moe_cluster.node.demo import MODEL_DIR

    tmp = Path(tempfile.mkdtemp(prefix="link-check-"))
    rounds = []
    with netns.hosts(["n1", "n2"]) as h:
        agents = []
        try:
            for name in ("n1", "n2"):
                ns, _ = h[name]
                if args.rate:
                    netns.shape(ns, args.rate)
                log = open(tmp / f"{name}.log", "w")
                agents.append(netns.agent(ns, name, log, ENV))
            yaml = "name: lab\nmodel: demo\nlaunch: remote\nkeepalive: none\nnodes:\n" + "".join(
                f"  - name: {n}\n    address: {h[n][1]}:7700\n" for n in ("n1", "n2")
            )
            (tmp / "cluster.yaml").write_text(yaml)
            link_cal = tmp / "link.json"
            transfer = min(16 << 20, max(1 << 20, args.rate // 8)) if args.rate else 64 << 20
            netns.wait_ready([tmp / f"{n}.log" for n in ("n1", "n2")])
            link = _cli("bench", "link", str(tmp / "cluster.yaml"), "--iters", str(args.iters),
                        "--transfer", str(transfer), "--out", str(link_cal), "--json")  # fmt: skip
            with cluster(tmp, yaml, env={"MOE_CLUSTER_SECRET": SECRET}) as (url, _, lines):
                for i in range(args.rounds):
                    # the compute is fitted now, the requests follow at once: both see one load
                    compute = _compute(tmp, i, args.tokens)
                    cal = tmp / f"cal-{i}.json"
                    measured_link = read_calibration(link_cal).link
                    write_calibration(read_calibration(compute).with_link(measured_link), cal)
                    tps = []
                    for _ in range(args.requests + (i == 0)):  # the very first warms up
                        code, out = http(url, "/v1/completions",
                                         {"prompt": PROMPT, "max_tokens": args.tokens,
                                          "temperature": 0})  # fmt: skip
                        assert code == 200, out
                        tps.append(out["moe_cluster"]["generation_tps"])
                    tps = tps[-args.requests :]
                    plan = _cli("plan", "--model", str(MODEL_DIR), "--calibration", str(cal),
                                "--nodes", "2", "--keepalive", "none", "--json")  # fmt: skip
                    measured = statistics.median(tps)
                    predicted = plan["rows"][0]["tokens_per_s"]
                    rounds.append(
                        {
                            "measured_tps": tps,
                            "measured_median_tps": measured,
                            "predicted_tps": predicted,
                            "miss": predicted / measured - 1,
                            "plan_row": plan["rows"][0],
                            "compute": json.loads(Path(compute).read_text()),
                        }
                    )
                said = [line for line in lines if "all-reduce per MoE layer" in line]
        finally:
            netns.stop(*agents)
    print(
        json.dumps(
            {
                "command": "tests/cluster/link_check.py " + " ".join(sys.argv[1:]),
                "rate_bps": args.rate,
                "link": link["link"],
                "rounds": rounds,
                "median_miss": statistics.median(r["miss"] for r in rounds),
                "up_said": said,
                "load_1min": os.getloadavg()[0],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

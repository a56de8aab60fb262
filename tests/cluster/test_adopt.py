"""The coordinator may die: `kill -9` of `up` while eight greedy streams decode on two node agents
(real processes on loopback, `launch: remote`, as under their services). The nodes drop the
orphaned sequences at once (their streams closed), stay loaded, and a new `up` on the same
cluster.yaml adopts them: no node restarted, nothing read from their shards, a client answered 503
with Retry-After (or refused before the new `up` binds its port) and then served, and the same
greedy tokens as before the kill. The 10-minute soak with a kill every two minutes is a benchmark
(`moe-cluster bench soak --kill coordinator`, docs/reliability.md)."""

from __future__ import annotations

from moe_cluster.coordinator.bench import adopt

ORPHANS_DROPPED_S = 2.0  # the bound; measured 0.07 s on the demo


def test_kill_the_coordinator_then_adopt(tmp_path):
    out = adopt.run(
        model="demo",
        nodes=2,
        streams=8,
        tokens=8,
        cut=2,
        fault="kill",
        coordinator_timeout="10s",
        workdir=tmp_path,
    )
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    r = out["restart"]
    assert out["lines"]["first"] and "loaded in" in out["lines"]["first"][-1], logs
    assert [list(n) for n in out["streams_on_nodes_at_fault"]] == [[8, 8], [8, 8]], out
    assert all(n >= 2 for n in out["stream_tokens_at_fault"]), out
    dropped = out["orphans_dropped_s"]
    assert None not in dropped and max(dropped) <= ORPHANS_DROPPED_S, (dropped, logs)
    assert r["adopted"] and r["node_pids_unchanged"], (r, out["lines"], logs)
    for n in r["node_bytes_read"]:  # the demo's shard is ~2.6 MB a node: none of it read again
        assert n is None or n < 64 * 1024, r
    answers = r["client_while_restarting"]["answers"]
    assert set(answers) <= {"ConnectionRefusedError", "503 Retry-After 2", "200"}, answers
    assert answers.get("200") == 1, answers
    assert out["same_tokens"], (out["reference"], out["after"])
    assert all(isinstance(t, list) and len(t) == 8 for t in out["reference"]), out["reference"]

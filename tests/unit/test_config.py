"""cluster.yaml validation: each malformed file gives one line naming the file, line and key."""

from __future__ import annotations

import pytest

from moe_cluster.coordinator.serve.config import ConfigError, load_config, parse_config, read_secret

GOOD = """\
name: lab
model: demo
launch: local
transport: envoy
keepalive: lru
nodes:
  - name: mac-1
  - name: mac-2
    port: 7702
placement:
  strategy: memory
  memory_fraction: 0.7
  kv_reserve: 1GiB
api:
  host: 127.0.0.1
  port: 8080
timeouts:
  collective: 2s
  discovery: 500ms
serving:
  prompt_cache: 64MB
"""


def test_a_good_file():
    c = parse_config(GOOD, "lab.yaml")
    assert [n.name for n in c.nodes] == ["mac-1", "mac-2"]
    assert c.nodes[1].port == 7702
    assert c.placement.kv_reserve == 2**30 and c.serving.prompt_cache == 64_000_000
    assert c.timeouts.collective == 2.0 and c.timeouts.discovery == 0.5
    assert c.source == "lab.yaml"
    assert c.nodes[0].gpu is None
    assert (
        parse_config(GOOD.replace("    port: 7702\n", "    port: 7702\n    gpu: 1\n")).nodes[1].gpu
        == 1
    )
    assert c.serving.recovery_wait == 15.0 and c.serving.max_resumes == 2  # the defaults
    waits = parse_config(GOOD + "  recovery_wait: 2m\n  max_resumes: 0\n").serving
    assert waits.recovery_wait == 120.0 and waits.max_resumes == 0
    assert c.timeouts.coordinator == 10.0  # the nodes' bound on a silent coordinator
    slow = parse_config("nodes:\n  - name: a\ntimeouts:\n  heartbeat: 5s\n").timeouts
    assert slow.coordinator == 15.0  # not given: three heartbeats at least


BAD = [
    # (file text, expected line, expected fragments)
    ("", 1, ["empty"]),
    ("{{{", 1, ["not valid YAML"]),
    ("nodes: 3", 1, ["nodes", "must be a list"]),
    ("nodes: []", 1, ["nodes", "at least one node"]),
    ("model: demo", 1, ["nodes", "is required"]),
    ("nodes:\n  - name: a\n    adress: x", 3, ["nodes[0].adress", "unknown key", "'address'"]),
    ("nodes:\n  - {}", 2, ["nodes[0].name", "is required"]),
    ("nodes:\n  - name: a\n  - name: a", 3, ["nodes[1].name", "used by nodes[0]"]),
    ("nodes:\n  - name: 'a b'", 2, ["nodes[0].name", "must be letters"]),
    ("nodes:\n  - name: a\n    port: x", 3, ["nodes[0].port", "whole number"]),
    ("nodes:\n  - name: a\n    port: 70000", 3, ["nodes[0].port", "not a port"]),
    ("nodes:\n  - name: a\n    address: 10.0.0.2", 3, ["nodes[0].address", "launch: remote"]),
    ("nodes:\n  - name: a\n    address: 'a b'", 3, ["nodes[0].address", "not a host"]),
    ("launch: remote\nnodes:\n  - name: a\n    gpu: 0", 4, ["nodes[0].gpu", "launch: local"]),
    ("nodes:\n  - name: a\n    gpu: -1", 3, ["nodes[0].gpu", "GPU index >= 0"]),
    ("nodes:\n  - name: a\n    gpu: first", 3, ["nodes[0].gpu", "whole number"]),
    ("nodes:\n  - name: a\nlaunch: cloud", 3, ["launch", "local, remote"]),
    ("nodes:\n  - name: a\ntransport: smoke-signals", 3, ["transport", "envoy, mlx"]),
    ("nodes:\n  - name: a\nkeepalive: sometimes", 3, ["keepalive", "none, lru, busy"]),
    ("nodes:\n  - name: a\nroute: fastest", 3, ["route", "measure, skip, device, host"]),
    (
        "nodes:\n  - name: a\ntimeouts:\n  heartbeat: 2s\n  coordinator: 4s",
        5,
        ["timeouts.coordinator", "twice the heartbeat's 2 s", "between heartbeats"],
    ),
    ("nodes:\n  - name: a\nmodel: /no/such/model", 3, ["model", "does not exist"]),
    ("nodes:\n  - name: a\nplacement: even", 3, ["placement", "mapping"]),
    (
        "nodes:\n  - name: a\nplacement:\n  strategy: profile",
        4,
        ["placement.profile", "needs a profile"],
    ),
    (
        "nodes:\n  - name: a\nplacement:\n  memory_fraction: 1.5",
        4,
        ["placement.memory_fraction", "(0, 1]"],
    ),
    (
        "nodes:\n  - name: a\nplacement:\n  kv_reserve: lots",
        4,
        ["placement.kv_reserve", "not a size"],
    ),
    (
        "nodes:\n  - name: a\ntimeouts:\n  collective: soon",
        4,
        ["timeouts.collective", "not a duration"],
    ),
    ("nodes:\n  - name: a\ntimeouts:\n  collective: 0", 4, ["timeouts.collective", "positive"]),
    ("nodes:\n  - name: a\ntimeouts:\n  heartbeet: 1s", 4, ["timeouts.heartbeet", "'heartbeat'"]),
    ("nodes:\n  - name: a\napi:\n  port: 99999", 4, ["api.port", "not a port"]),
    ("nodes:\n  - name: a\napi:\n  api_key_env: K\n  api_key_file: f", 4, ["api", "not both"]),
    ("nodes:\n  - name: a\nsecret:\n  env: X\n  file: y", 4, ["secret", "not both"]),
    ("nodes:\n  - name: a\ntls:\n  cert: c.pem", 4, ["tls.key", "is required"]),
    ("nodes:\n  - name: a\nserving:\n  queue: 0", 4, ["serving.queue", "at least 1"]),
    (
        "nodes:\n  - name: a\nserving:\n  prefill_chunk: 4",
        4,
        ["serving.prefill_chunk", "at least 16"],
    ),
    ("nodes:\n  - name: a\nserving:\n  recovery_wait: 0", 4, ["serving.recovery_wait", "positive"]),
    (
        "nodes:\n  - name: a\nserving:\n  recovery_wait: a while",
        4,
        ["serving.recovery_wait", "not a duration"],
    ),
    ("nodes:\n  - name: a\nserving:\n  max_resumes: -1", 4, ["serving.max_resumes", "at least 0"]),
    (
        "nodes:\n  - name: a\nserving:\n  max_resumes: 1.5",
        4,
        ["serving.max_resumes", "whole number"],
    ),
    ("nodes:\n  - name: a\nserving:\n  max_resume: 1", 4, ["serving.max_resume", "'max_resumes'"]),
    (
        "nodes:\n  - name: a\nserving:\n  speculative: guess",
        4,
        ["serving.speculative", "off, auto, prompt-lookup, draft"],
    ),
    ("nodes:\n  - name: a\nserving:\n  draft_tokens: 17", 4, ["serving.draft_tokens", "1 to 16"]),
    (
        "nodes:\n  - name: a\nserving:\n  speculative: draft",
        4,
        ["serving.speculative", "needs serving.draft_model"],
    ),
    (
        "nodes:\n  - name: a\nserving:\n  draft_model: demo",
        4,
        ["serving.draft_model", "needs speculative: draft"],
    ),
    (
        "nodes:\n  - name: a\nserving:\n  speculative: draft\n  draft_model: /no/draft",
        5,
        ["serving.draft_model", "/no/draft does not exist"],
    ),
    (
        "nodes:\n  - name: a\ncheckpoint: coordinator\nserving:\n  speculative: draft\n  draft_model: demo",
        6,
        ["serving.draft_model", "checkpoint: coordinator ships only the model"],
    ),
    (
        "nodes:\n  - name: a\ncheckpoint: coordinator\nserving:\n  speculative: mtp",
        5,
        ["serving.speculative", "checkpoint: coordinator ships only each node's shard"],
    ),
    (
        "nodes:\n  - name: a\nserving:\n  mtp_experts: whole",
        4,
        ["serving.mtp_experts", "whole needs speculative: mtp (got auto)"],
    ),
    (
        "nodes:\n  - name: a\nserving:\n  speculative: mtp\n  mtp_experts: half",
        5,
        ["serving.mtp_experts", "auto, whole, sharded"],
    ),
    (
        "nodes:\n  - name: a\nserving:\n  attention: by-stream\n  speculative: mtp",
        4,
        ["serving.attention", "cannot run with speculative: mtp"],
    ),
    ("nodes:\n  - name: a\nnodes:\n  - name: b", 3, ["nodes", "given twice"]),
    (
        "nodes:\n  - name: a\nplacement:\n  replicate: maybe",
        4,
        ["placement.replicate", "true or false"],
    ),
    (
        "nodes:\n  - name: a\nplacement:\n  expert_cache: most",
        4,
        ["placement.expert_cache", "a percent (50%)"],
    ),
    ("nodes:\n  - name: a\n    expert_cache: 120%", 3, ["nodes[0].expert_cache", "(0, 100]"]),
    ("nodes:\n  - name: a\nfrobnicate: 1", 3, ["frobnicate", "unknown key"]),
    ("nodes:\n  - name: a\n    envoy_data_port: 0", 3, ["nodes[0].envoy_data_port", "not a port"]),
    (
        "nodes:\n  - name: a\n    envoy_data_port: 7701\ntransport: mlx",
        3,
        ["nodes[0].envoy_data_port", "transport: envoy"],
    ),
    (
        "nodes:\n  - name: a\n    envoy_port: 7701\n    envoy_data_port: 7701",
        4,
        ["nodes[0].envoy_data_port", "7701 is this node's envoy_port too"],
    ),
]


@pytest.mark.parametrize("text, line, fragments", BAD)
def test_malformed_files(text, line, fragments, tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{f}:{line}: "), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_secret_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_SECRET", "s3cret")
    c = parse_config("nodes:\n  - name: a\nsecret:\n  env: LAB_SECRET\n", str(tmp_path / "c.yaml"))
    assert read_secret(c) == "s3cret"
    (tmp_path / "secret.txt").write_text("from-file\n")
    c = parse_config("nodes:\n  - name: a\nsecret:\n  file: secret.txt\n", str(tmp_path / "c.yaml"))
    assert read_secret(c) == "from-file"


def test_a_file_that_is_not_utf8_is_an_error_naming_the_file_and_line(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_bytes(GOOD.encode() + b"# caf\xe9 in Latin-1\n")
    with pytest.raises(ConfigError, match=rf"^{f}:{GOOD.count(chr(10)) + 1}: not UTF-8 text"):
        load_config(f)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("api:\n  metrics_auth: 'yes'\n", "api.metrics_auth"),
        ("api:\n  metrics_auth: 1\n", "api.metrics_auth"),
        ("api:\n  metrics_aut: true\n", "did you mean 'metrics_auth'"),
        ("api:\n  max_body: 12\n", "api.max_body"),
        ("api:\n  max_body: lots\n", "api.max_body"),
    ],
)
def test_api_metrics_auth_and_max_body_are_validated_strictly(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(GOOD.replace("api:\n  host: 127.0.0.1\n  port: 8080\n", text))


def test_api_metrics_auth_and_max_body_defaults_and_values():
    c = parse_config(GOOD)
    assert c.api.metrics_auth is False and c.api.max_body == 16 * 2**20
    c = parse_config(
        GOOD.replace("  port: 8080\n", "  port: 8080\n  metrics_auth: true\n  max_body: 2MB\n")
    )
    assert c.api.metrics_auth is True and c.api.max_body == 2_000_000


def test_checkpoint_on_the_coordinator_only():
    c = parse_config(
        GOOD + "checkpoint: coordinator\nship:\n  port: 0\n  chunk: 256KiB\n  max_rate: 100MB\n",
        "lab.yaml",
    )
    assert c.checkpoint == "coordinator" and c.ship.port == 0 and c.ship.chunk == 256 * 2**10
    assert c.ship.max_rate == 100_000_000
    assert parse_config(GOOD, "lab.yaml").checkpoint == "every-node"


@pytest.mark.parametrize(
    "extra, message",
    [
        ("ship:\n  port: 7702\n", "lab.yaml:23: ship: applies only with checkpoint: coordinator"),
        (
            "checkpoint: nodes\n",
            "lab.yaml:22: checkpoint: must be one of every-node, coordinator (got 'nodes')",
        ),
        (
            "checkpoint: coordinator\nship:\n  chunk: 16MB\n",
            "lab.yaml:24: ship.chunk: must be 64KiB to 4MiB (got 16000000 bytes)",
        ),
        (
            "checkpoint: coordinator\nship:\n  port: 70000\n",
            "lab.yaml:24: ship.port: 70000 is not a port (0..65535)",
        ),
        ("checkpoint: coordinator\nship:\n  rate: 1MB\n", "lab.yaml:24: ship.rate: unknown key"),
    ],
)
def test_bad_ship_settings(extra, message):
    with pytest.raises(ConfigError) as exc:
        parse_config(GOOD + extra, "lab.yaml")
    assert str(exc.value).startswith(message), str(exc.value)

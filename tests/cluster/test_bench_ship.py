"""`bench ship --json` through the CLI: shipping a real cache against raw TCP between the same two
endpoints, on loopback and over a rate-limited link in a namespace the bench makes and removes.
Rates are not asserted (they are the benchmark's output) except where the link bounds them."""

from __future__ import annotations

import json
import statistics
import subprocess

import netns
import pytest

from conftest import assert_one_line_error, cli

MB = 1_000_000


def _run(*extra: str) -> dict:
    r = cli("bench", "ship", "--size", "64MB", "--blob", "16MB", "--json", *extra, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_loopback_reports_every_field_and_a_small_coordinator():
    out = _run()
    assert out["bytes"] == 64 * MB and out["seconds"] > 0
    assert out["rate_bytes_per_s"] == pytest.approx(out["bytes"] / out["seconds"])
    # the later ships' median against raw TCP's, every run listed: 3 later ships, raw before and after each
    runs = out["rounds"]
    assert len(runs["ship_seconds"]) == 3 and len(runs["raw_tcp_seconds"]) == 4
    assert out["seconds"] == sorted(runs["ship_seconds"])[1]
    assert out["raw_tcp_bytes_per_s"] == pytest.approx(
        out["bytes"] / statistics.median(runs["raw_tcp_seconds"])
    )
    assert out["ratio"] == pytest.approx(out["rate_bytes_per_s"] / out["raw_tcp_bytes_per_s"])
    assert out["first_ship_ratio"] == pytest.approx(
        out["bytes"] / out["first_ship_seconds"] / out["raw_tcp_bytes_per_s"]
    )
    # the first ship hashed every blob once; the second reused those digests
    assert out["coordinator_hashed_bytes"] == 64 * MB
    # the kernel sends the bytes, and hashing reads a piece at a time: the coordinator's Python
    # never holds a blob
    assert out["coordinator_traced_peak_bytes"] < 16 * MB and out["link"] == ""


def _namespaces() -> set[str]:
    return set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )


@pytest.mark.needs(netns.available(), netns.INSTALL)
def test_a_shaped_link_bounds_raw_tcp_and_leaves_nothing_behind():
    before = _namespaces()
    out = _run("--link", "1gbit")
    assert out["link"] == "1gbit" and out["netns"].startswith("mcs")
    assert (
        0 < out["raw_tcp_bytes_per_s"] <= 125 * MB * 1.15
    )  # 1 Gbit/s, and the token bucket's burst
    assert 0 < out["ratio"] <= 1.3
    assert _namespaces() <= before  # its namespace (and veth) are gone


@pytest.mark.needs(netns.available(), netns.INSTALL)
def test_an_unshaped_veth_is_another_host():
    before = _namespaces()
    out = _run("--link", "veth")
    assert out["link"] == "veth" and out["netns"].startswith("mcs") and out["bytes"] == 64 * MB
    assert _namespaces() <= before


def test_a_bad_link_rate_is_one_line():
    r = cli("bench", "ship", "--link", "fast")
    assert_one_line_error(r, "--link must be a rate like 10gbit", "or veth", "fast")


def test_rounds_below_one_is_one_line():
    r = cli("bench", "ship", "--rounds", "0")
    assert_one_line_error(r, "--rounds must be at least 1", "0")

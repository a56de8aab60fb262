"""`moe-cluster validate` as a user runs it: it reads the secret and the API key as `up` would."""

from __future__ import annotations

import os

from conftest import assert_one_line_error, cli
from unit.test_config import GOOD


def test_validate_reads_the_secret_file_and_the_api_key_variable_as_up_does(tmp_path):
    base = GOOD.replace("  port: 8080\n", "  port: 8080\n  api_key_env: MOE_TEST_VALIDATE_KEY\n")
    f = tmp_path / "cluster.yaml"
    env = {k: v for k, v in os.environ.items() if k != "MOE_TEST_VALIDATE_KEY"}
    f.write_text(base)
    assert_one_line_error(
        cli("validate", str(f), env=env), f"{f}: api.api_key_env", "MOE_TEST_VALIDATE_KEY"
    )
    assert cli("validate", str(f), env={**env, "MOE_TEST_VALIDATE_KEY": "k"}).returncode == 0
    f.write_text(GOOD + "secret:\n  file: nowhere/secret.txt\n")
    assert_one_line_error(
        cli("validate", str(f), env=env), f"{f}: secret.file", "nowhere/secret.txt"
    )
    f.write_text(
        GOOD.replace("launch: local", "launch: remote")
        + "secret:\n  env: MOE_TEST_NO_SUCH_SECRET\n"
    )
    assert_one_line_error(
        cli("validate", str(f), env=env), f"{f}: secret", "MOE_TEST_NO_SUCH_SECRET"
    )


def test_up_refuses_a_checkpoint_whose_tokenizer_cannot_load(tmp_path):
    import shutil

    from moe_cluster.node.demo import MODEL_DIR

    ckpt = tmp_path / "ckpt"
    shutil.copytree(MODEL_DIR, ckpt)
    (ckpt / "tokenizer.json").write_text("{not json")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"model: {ckpt}\nnodes:\n  - name: a\n  - name: b\n")
    r = cli("up", str(cfg), "--api-port", "0", timeout=120)
    assert_one_line_error(r, "cannot load the tokenizer", str(ckpt))

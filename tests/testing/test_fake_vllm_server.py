"""lightning_gkd.testing.fake_vllm_server as a process's server: a saved model served with vLLM's JSON until stopped
(the toy studies' served teacher). Its answers are checked against the in-process teacher in
tests/teachers/test_server.py."""

import json
import subprocess
import sys
import urllib.request

import pytest

from lightning_gkd.testing.fake_vllm_server import serve_folder
from lightning_gkd.toy.tiny import asset_path


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read() or b"{}")


def test_a_saved_model_is_served_with_its_eos_and_the_given_limits():
    server = serve_folder(asset_path("toy/teacher"), max_logprobs=1, max_model_len=96)
    try:
        assert server.max_logprobs == 1 and server.max_model_len == 96 and server.eos_token_id == 2
        assert [card["id"] for card in get(server.url + "/v1/models")["data"]] == ["toy-teacher"]
    finally:
        server.stop()


@pytest.mark.slow  # starts a process
def test_the_module_runs_as_a_process_that_prints_its_address_and_stops_on_sigterm():
    command = [sys.executable, "-m", "lightning_gkd.testing.fake_vllm_server", "--model", asset_path("toy/teacher")]
    process = subprocess.Popen([*command, "--max-logprobs", "1"], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving {asset_path('toy/teacher')} at http://127.0.0.1:")
        get(line.split(" at ")[-1].strip() + "/health")
    finally:
        process.terminate()
    assert process.wait(timeout=30) == 0

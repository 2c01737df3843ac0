"""push_to_hub: create_repo + upload_folder with the token from $HF_TOKEN only; clear offline/auth errors.
The hub is never contacted: HfApi is replaced, or offline mode blocks the request before it is sent."""

import httpx2 as httpx
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError

from lightning_gkd.cli.hub import HubPushError, check_push_settings, push_folder

SECRET = "hf_not_a_real_token_123"


class FakeApi:
    instances: list["FakeApi"] = []
    fail_with: Exception | None = None

    def __init__(self, token=None):
        self.token, self.calls = token, []
        FakeApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        if FakeApi.fail_with is not None:
            raise FakeApi.fail_with
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))


@pytest.fixture()
def fake_api(monkeypatch):
    FakeApi.instances, FakeApi.fail_with = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return FakeApi


@pytest.fixture()
def folder(tmp_path):
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "README.md").write_text("card")
    return tmp_path / "student"


def test_creates_the_repo_then_uploads_the_folder(fake_api, folder, capsys):
    url = push_folder(folder, "me/my-student", private=True)
    assert url == "https://huggingface.co/me/my-student"
    (api,) = fake_api.instances
    assert api.token == SECRET
    assert api.calls[0] == ("create_repo", "me/my-student", {"private": True, "repo_type": "model", "exist_ok": True})
    assert api.calls[1][0] == "upload_folder"
    assert api.calls[1][1]["repo_id"] == "me/my-student" and api.calls[1][1]["folder_path"] == str(folder)
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert all(SECRET not in path.read_text() for path in folder.iterdir())


def test_no_token_in_the_environment_is_refused_before_any_call(fake_api, folder, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubPushError, match="needs a Hugging Face token in the environment variable HF_TOKEN"):
        push_folder(folder, "me/x")
    with pytest.raises(HubPushError, match="HF_TOKEN"):
        check_push_settings("me/x")
    assert fake_api.instances == []


def test_a_rejected_token_names_the_repo_and_the_fix(fake_api, folder):
    request = httpx.Request("POST", "https://huggingface.co/api/repos/create")
    fake_api.fail_with = HfHubHTTPError("401 Unauthorized", response=httpx.Response(401, request=request))
    with pytest.raises(HubPushError) as error:
        push_folder(folder, "me/x")
    message = str(error.value)
    assert "Cannot push to 'me/x'" in message and "rejected the token in HF_TOKEN (HTTP 401)" in message
    assert f"hf upload me/x {folder}" in message and SECRET not in message


def test_offline_mode_is_a_clear_error_with_the_real_client(folder, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubPushError, match=r"Cannot push to 'me/x': Hugging Face offline mode is on"):
        push_folder(folder, "me/x")  # the real HfApi: its request hook refuses before sending
    with pytest.raises(HubPushError, match="offline mode is on"):
        check_push_settings("me/x")


def test_settings_need_a_repo_id(fake_api):
    with pytest.raises(HubPushError, match=r"needs hub_model_id=<user or org>/<name>, got None"):
        check_push_settings(None)

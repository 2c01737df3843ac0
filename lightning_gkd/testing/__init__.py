"""Test doubles the test suite and the studies share: ``fake_vllm_server.FakeVLLMServer``, a stand-in for vLLM's
OpenAI-compatible server answered by a Hugging Face model (no vLLM needed)."""

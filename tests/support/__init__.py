"""Helpers shared by the test modules: engine settings and oracles (`engine`), real-server and
SDK-client launchers (`servers`), the OpenAI and Anthropic SDK suites run against every
deployment (`openai_suite`, `anthropic_suite`), a stand-in engine front (`fakes`) and an operation counter
for complexity checks (`complexity`). Fixtures are registered in tests/conftest.py."""

import pytest

# The SDK suites' test bodies live here: pytest rewrites their asserts as it does a test module's.
pytest.register_assert_rewrite("tests.support.openai_suite", "tests.support.anthropic_suite")

"""Schemathesis against the app's own OpenAPI schema: generated bodies, valid and not, never
produce a 5xx, invalid ones are rejected, and every answer matches the documented status codes,
content types and shapes."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from cluster.http.app import create_app
from cluster.text.tokenizer import ByteTokenizer
from tests.conftest import make_engine
from workers.engine_runner import EngineRunner


class LateRunner:
    """Forwards to the engine runner the fixture starts: the schema is loaded at import time,
    before any fixture exists. max_model_len 32 bounds every generated request to a few steps."""

    max_model_len = 32
    runner: EngineRunner | None = None

    @property
    def num_unfinished(self) -> int:
        return self.runner.num_unfinished if self.runner else 0

    def submit(self, *args):
        return self.runner.submit(*args)

    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    def attach_metrics(self, metrics) -> None:
        pass


BACKEND = LateRunner()
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(BACKEND, "tiny", tokenizer=ByteTokenizer()))


@pytest.fixture(scope="module")
def engine(tiny_model):
    BACKEND.runner = EngineRunner(make_engine(tiny_model, max_model_len=BACKEND.max_model_len, num_spec_tokens=0))
    yield
    BACKEND.runner.shutdown()


@pytest.mark.timeout(120)
@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case, engine):
    # all checks but "schema-valid data is accepted": the vocabulary, max_model_len and the KV
    # budget are limits the schema cannot state, and they reject with a documented 400
    case.call_and_validate(excluded_checks=[positive_data_acceptance])

"""Which object-storage errors the store tries again: the words and HTTP statuses of the answer, never
digits that happen to sit in the request's URL (a port, a random prefix)."""

from __future__ import annotations

import pytest

from moescope.store.delta.retries import transient

RESET = ("Generic S3 error | Error performing PUT http://127.0.0.1:{port}/moescope-test/{prefix}/routes/_delta_log/"
         "00000000000000000000.json in 211.848µs - HTTP error | error sending request | client error (SendRequest) "
         "| connection error | Connection reset by peer (os error 104)")


@pytest.mark.parametrize("port,prefix", [(40359, "t-52640af7"), (15030, "t-a503b"), (8080, "run-403-x"),
                                         (50300, "t-5004")])
def test_a_reset_is_transient_whatever_digits_its_url_holds(port, prefix):
    assert transient(OSError(RESET.format(port=port, prefix=prefix)))


@pytest.mark.parametrize("text", [
    "Generic S3 error: Error performing PUT http://127.0.0.1:9000/b/k in 2ms, got 503 Service Unavailable",
    "Server returned non-2xx status code: 500 Internal Server Error: <Code>InternalError</Code>",
    "HTTP status server error (502 Bad Gateway) for url (http://127.0.0.1:9000/b/k)",
    "<Code>SlowDown</Code><Message>Please reduce your request rate.</Message>",
    "operation timed out",
])
def test_a_server_that_may_answer_differently_next_time_is_transient(text):
    assert transient(OSError(text))


@pytest.mark.parametrize("text", [
    "Client error with status 403 Forbidden: <Code>AccessDenied</Code>",
    "HTTP status client error (403 Forbidden) for url (http://127.0.0.1:15030/b/k)",
    "<Code>NoSuchBucket</Code>: The specified bucket does not exist",
    "<Code>SignatureDoesNotMatch</Code>",
    "Generic S3 error: 404 Not Found",
])
def test_a_refusal_that_will_not_change_is_not_retried(text):
    assert not transient(OSError(text))

"""`moescope alerts ...` refuses what it cannot do safely."""

from __future__ import annotations

from moescope.cli import main as moescope_main


def test_test_webhook_refuses_an_unset_secret_instead_of_sending_unsigned(receiver, monkeypatch, capsys):
    monkeypatch.delenv("MOESCOPE_UNSET_SECRET", raising=False)
    code = moescope_main(["alerts", "test-webhook", receiver.url + "/hook", "--secret-env", "MOESCOPE_UNSET_SECRET"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--secret-env MOESCOPE_UNSET_SECRET: that environment variable is not set or empty" in err
    monkeypatch.setenv("MOESCOPE_UNSET_SECRET", "")
    assert moescope_main(["alerts", "test-webhook", receiver.url + "/hook",
                          "--secret-env", "MOESCOPE_UNSET_SECRET"]) == 2
    assert receiver.received() == []
    # the same refusal as `alerts run`
    assert moescope_main(["alerts", "run", "nowhere", "--webhook", receiver.url,
                          "--secret-env", "MOESCOPE_UNSET_SECRET"]) == 2
    assert "MOESCOPE_UNSET_SECRET: that environment variable is not set or empty" in capsys.readouterr().err

"""sbp's tests, one package per layer of sbp (tests/<layer>/ mirrors sbp/<layer>/); shared helpers in tests/support."""

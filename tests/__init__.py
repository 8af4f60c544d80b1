"""The test-suite is a regular package, so `tests.tiers` & co. are ours even when another
installed distribution ships a top-level ``tests`` package (verl's wheel does): a regular
package earlier on sys.path (pytest puts the repo root first) wins, while a namespace
folder would lose to any installed regular package (tests/test_test_package.py)."""

"""Helpers the test files share (fixtures live in tests/conftest.py); no test file imports
from another test file (tests/test_test_layout.py checks it)."""

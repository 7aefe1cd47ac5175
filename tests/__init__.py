"""The test suite is a package so that its helpers import as ``tests._oracle`` from any test file."""

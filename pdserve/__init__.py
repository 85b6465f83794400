"""pdserve.v1: the generated gRPC stubs; pdserve.cli: the command line.

Imports nothing: every server imports pdserve.v1, which runs this file first."""

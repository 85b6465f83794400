"""Plumbing shared by every pdserve gRPC server and client: server setup
(health, reflection, graceful drain), proto <-> engine conversions and
channel options. Imports engine value objects and the generated stubs;
never the services."""

"""Running the coordinator and the nodes as services: the system's supervisor's units (launchd,
systemd) and the coordinator's own restart loop, which holds the API's socket across restarts."""

"""The process service (E2B envd's process.Process): spawning, the process table, login
environments, the zombie reaper, and sudo brokered for the default user."""

"""Messages generated from the shared E2B protos (`make proto`)."""

"""`kvxfer-cli`: handshake debugging, planning and the P/D demo."""

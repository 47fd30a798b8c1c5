"""Pure metrics: functions of recorded expert loads and routes (numpy only)."""

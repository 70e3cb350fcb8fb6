"""TorchServe's surface: config.properties and TS_* variables (`properties`), its command line
(`flags`, `command`), token authorization (`tokens`), its metrics names and exposition
(`metrics`, `exposition`), its log files (`logs/`, `logdirs`) and its request body forms
(`forms`, `part_headers`)."""

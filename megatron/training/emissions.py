"""Energy and CO2 accounting with codecarbon for --codecarbon-dir (a no-op flag in Megatron-DeepSpeed).

Each rank runs codecarbon's ``OfflineEmissionsTracker``: no network, the carbon intensity of the
given country's energy mix (default "FRA": BigScience trained at IDRIS, France), power from RAPL /
NVML where readable and codecarbon's estimates otherwise. Rank r appends its measurements to
``{codecarbon_dir}/emissions-{r:03d}.csv`` (Megatron-DeepSpeed's file name) at every ``flush``
(Megatron-DeepSpeed flushed after each checkpoint save) and at ``stop``.

codecarbon catches its own errors and only logs them, so a tracker that failed silently would
write nothing; ``stop`` therefore checks that the CSV exists and raises EmissionsError otherwise.
"""
import os

DEFAULT_COUNTRY_ISO_CODE = "FRA"


class EmissionsError(RuntimeError):
    """codecarbon is missing, misconfigured, or wrote no emissions file."""


def _import_codecarbon():
    try:
        import codecarbon
    except ImportError as error:
        raise EmissionsError("--codecarbon-dir needs the codecarbon package: pip install codecarbon "
                             "(or drop --codecarbon-dir)") from error
    return codecarbon


def _check_country(country_iso_code: str):
    from codecarbon.input import DataSource
    known = DataSource().get_global_energy_mix_data()
    if country_iso_code not in known:
        raise EmissionsError(f"codecarbon has no energy mix for country ISO code {country_iso_code!r}; "
                             f"use an ISO 3166-1 alpha-3 code such as {DEFAULT_COUNTRY_ISO_CODE!r}")


class EmissionsTracker:
    """start() / flush() / stop() around training; writes ``emissions-{rank:03d}.csv`` in ``output_dir``.

    ``measure_power_secs`` is codecarbon's sampling period of the power draw.
    """

    def __init__(self, output_dir: str, rank: int, country_iso_code: str = DEFAULT_COUNTRY_ISO_CODE,
                 measure_power_secs: float = 15.0, log_level: str = "error"):
        codecarbon = _import_codecarbon()
        _check_country(country_iso_code)
        os.makedirs(output_dir, exist_ok=True)
        self.output_path = os.path.join(output_dir, f"emissions-{rank:03d}.csv")
        self._tracker = codecarbon.OfflineEmissionsTracker(
            project_name="megatron", output_dir=output_dir, output_file=os.path.basename(self.output_path),
            country_iso_code=country_iso_code, measure_power_secs=measure_power_secs, log_level=log_level,
            save_to_file=True, allow_multiple_runs=True)
        self._running = False

    def start(self):
        if self._running:
            raise EmissionsError("the emissions tracker is already running")
        self._tracker.start()
        self._running = True

    def flush(self):
        """Append the measurements so far to the CSV (kept if the run dies later)."""
        if self._running:
            self._tracker.flush()

    def stop(self) -> float:
        """Stop tracking; returns the emissions in kg CO2-eq and checks that the CSV was written."""
        if not self._running:
            raise EmissionsError("the emissions tracker was not started")
        emissions = self._tracker.stop()
        self._running = False
        if emissions is None or not os.path.isfile(self.output_path):
            raise EmissionsError(f"codecarbon wrote no emissions file at {self.output_path}; "
                                 "see its log messages above")
        return emissions

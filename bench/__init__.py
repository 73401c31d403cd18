"""The benchmarks: each module compares a candidate against a baseline measured in the same run
(``python -m bench.<name>``; ``epd bench`` runs some of them). ``common`` times, summarises and
reports; ``service_proc``, ``loadgen``, ``media_corpus`` and ``peers`` start services and drive load.

Benchmarks run from a source checkout only: the package is not in the wheel. A benchmark may import
the product packages and the shared test fixtures (``tests.fixtures``: clips, the media server,
tiny checkpoints); nothing in the product imports ``bench``.
"""

from epd_common.mkl_dispatch import use_mkl_avx512

use_mkl_avx512()  # before any benchmark loads torch: in-process runs measure what epd's processes run

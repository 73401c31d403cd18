"""The test packages. Importing this package first (pytest does, before any conftest or test
module loads torch) applies what every epd process applies before torch: ``use_mkl_avx512``."""

from epd_common.mkl_dispatch import use_mkl_avx512

use_mkl_avx512()

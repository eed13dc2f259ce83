//! Intel AMX int8 tile products on x86-64 Linux: whether they run here (the CPU's AMX-TILE and
//! AMX-INT8, AVX-512BW, and the kernel's leave to use tile data), the tile configuration the kernels
//! of [`super::int8_attention`] share (all eight tiles 16 rows × 64 bytes), and those kernels' steps.
//! The instructions are written as inline assembly (Rust's AMX intrinsics are not stable).

/// Whether AMX-INT8 runs here (`EDGERUN_NO_AMX=1` or `EDGERUN_NO_INT8=1`: never).
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| std::env::var_os("EDGERUN_NO_INT8").is_none() && tiles_run_with(AMX_INT8))
}

/// Whether AMX-BF16 runs here, with AVX-512 BF16 for the packing around it (`EDGERUN_NO_AMX=1`: never).
pub fn bf16_available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| tiles_run_with(AMX_BF16) && avx512_bf16())
}

/// Whether the CPU converts f32 to bf16 in AVX-512 (`vcvtneps2bf16`).
fn avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// CPUID leaf 7's EDX bit for AMX-INT8 (not in `is_x86_feature_detected!` on stable).
const AMX_INT8: u32 = 1 << 25;
/// CPUID leaf 7's EDX bit for AMX-BF16.
const AMX_BF16: u32 = 1 << 22;

/// Whether the CPU has AMX-TILE, the instruction set `set` (a CPUID leaf 7 EDX bit), AVX-512F and
/// AVX-512BW, Linux lets this process use tile data, and `EDGERUN_NO_AMX` is not set.
fn tiles_run_with(set: u32) -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static PERMITTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        const AMX_TILE: u32 = 1 << 24;
        if std::env::var_os("EDGERUN_NO_AMX").is_some() || !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("avx512bw") {
            return false;
        }
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (AMX_TILE | set) == AMX_TILE | set && *PERMITTED.get_or_init(request_tile_data)
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = set;
        false
    }
}

/// Asks Linux for this process's leave to use AMX tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`); false where the kernel refuses or predates AMX.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl with this request only changes the process's permitted xsave features;
    // the syscall instruction clobbers rcx and r11 and touches no user memory.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

#[cfg(target_arch = "x86_64")]
pub(crate) use kernels::*;

#[cfg(target_arch = "x86_64")]
mod kernels {
    use std::arch::asm;

    /// The 64-byte operand of `ldtilecfg` / `sttilecfg`: byte 0 the palette (0: no tiles), bytes
    /// 16.. each tile's row width in bytes (u16), bytes 48.. each tile's rows.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    impl Config {
        /// Palette 1 with tiles 0–7 of 16 rows × 64 bytes.
        fn ours() -> Config {
            let mut c = [0u8; 64];
            c[0] = 1;
            for t in 0..8 {
                c[16 + 2 * t..][..2].copy_from_slice(&64u16.to_le_bytes());
                c[48 + t] = 16;
            }
            Config(c)
        }

        /// Loads this configuration (palette 0 releases the tiles).
        ///
        /// # Safety
        /// AMX runs here and the configuration is valid.
        unsafe fn load(&self) {
            // SAFETY: what this function's `# Safety` section requires is what these instructions need.
            unsafe {
                if self.0[0] == 0 {
                    asm!("tilerelease", options(nostack, nomem));
                } else {
                    asm!("ldtilecfg [{}]", in(reg) self, options(nostack, readonly));
                }
            }
        }

        /// The thread's configuration (zeros where it has none).
        ///
        /// # Safety
        /// AMX runs here.
        unsafe fn stored() -> Config {
            let mut c = Config([0; 64]);
            // SAFETY: what this function's `# Safety` section requires is what these instructions need.
            unsafe { asm!("sttilecfg [{}]", in(reg) &mut c, options(nostack)) };
            c
        }
    }

    /// The thread's tiles configured as eight 16 × 64-byte tiles while it lives; the configuration
    /// the thread had before (another kernel's, or none) is put back when it drops.
    pub(crate) struct Tiles {
        saved: Config,
    }

    impl Tiles {
        /// Saves the thread's tile configuration and loads this module's.
        ///
        /// # Safety
        /// [`super::available`] returned true.
        #[inline]
        pub(crate) unsafe fn configure() -> Tiles {
            // SAFETY: AMX runs here; ours is a valid configuration.
            unsafe {
                let saved = Config::stored();
                Config::ours().load();
                Tiles { saved }
            }
        }
    }

    impl Drop for Tiles {
        fn drop(&mut self) {
            // SAFETY: puts back what `sttilecfg` saved (AMX ran when it was taken).
            unsafe { self.saved.load() };
        }
    }

    /// Loads a raw 64-byte tile configuration (tests: another kernel's, or none).
    ///
    /// # Safety
    /// AMX runs here and `config` is a valid configuration.
    #[cfg(test)]
    pub(crate) unsafe fn load_config(config: &[u8; 64]) {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe { Config(*config).load() };
    }

    /// The thread's tile configuration as `sttilecfg` stores it (zeros where it has none).
    ///
    /// # Safety
    /// AMX runs here.
    #[cfg(test)]
    pub(crate) unsafe fn stored_config() -> [u8; 64] {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe { Config::stored().0 }
    }

    /// Stores the int32 sums of tiles 0–3 at `c[0..4]`, rows `ldc` bytes apart.
    ///
    /// # Safety
    /// [`Tiles::configure`] is in force and each address has 16 rows of 64 writable bytes.
    #[inline]
    unsafe fn store_sums(c: [*mut i32; 4], ldc: usize) {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe {
            asm!(
                "tilestored [{c0} + {ldc}*1], tmm0",
                "tilestored [{c1} + {ldc}*1], tmm1",
                "tilestored [{c2} + {ldc}*1], tmm2",
                "tilestored [{c3} + {ldc}*1], tmm3",
                c0 = in(reg) c[0],
                c1 = in(reg) c[1],
                c2 = in(reg) c[2],
                c3 = in(reg) c[3],
                ldc = in(reg) ldc,
                options(nostack)
            );
        }
    }

    /// 32 × 32 int32 sums `a · bᵀ` of signed bytes: `a` two 16-row tiles (`a` and `a + 16·lda`,
    /// rows `lda` bytes apart), `b0` and `b1` two 16-column tiles in the VNNI layout (16 rows of 4
    /// bytes × 16 columns, 1 KiB each, the next depth step 1 KiB after), over `steps` steps of 64
    /// bytes of depth; stored at `c` (rows `ldc` bytes apart; `b1`'s columns 64 bytes right).
    ///
    /// # Safety
    /// [`Tiles::configure`] is in force on this thread and every address is inside its buffer.
    #[inline]
    pub(crate) unsafe fn dot_s8_32x32(a: *const i8, lda: usize, b0: *const i8, b1: *const i8, steps: usize, c: *mut i32, ldc: usize) {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            for s in 0..steps {
                asm!(
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tileloadd tmm6, [{b0} + {ldb}*1]",
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {ldb}*1]",
                    "tdpbssd tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {lda}*1]",
                    "tdpbssd tmm2, tmm5, tmm6",
                    "tdpbssd tmm3, tmm5, tmm7",
                    a0 = in(reg) a.add(s * 64),
                    a1 = in(reg) a.add(16 * lda + s * 64),
                    b0 = in(reg) b0.add(s * 1024),
                    b1 = in(reg) b1.add(s * 1024),
                    lda = in(reg) lda,
                    ldb = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
            store_sums([c, c.byte_add(64), c.byte_add(16 * ldc), c.byte_add(16 * ldc + 64)], ldc);
        }
    }

    /// 16 × 64 int32 sums `a · b` of unsigned bytes `a` (16 rows, `lda` bytes apart) and signed
    /// bytes `b`: for each of `steps` depth steps of 64, four 16-column tiles in the VNNI layout,
    /// 1 KiB each, contiguous from `b + step · b_step` bytes; stored at `c` (rows 256 bytes apart).
    ///
    /// # Safety
    /// As [`dot_s8_32x32`].
    #[inline]
    pub(crate) unsafe fn dot_u8s8_16x64(a: *const u8, lda: usize, b: *const i8, b_step: usize, steps: usize, c: *mut i32) {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            for s in 0..steps {
                let bs = b.add(s * b_step);
                asm!(
                    "tileloadd tmm4, [{a} + {lda}*1]",
                    "tileloadd tmm5, [{b0} + {ldb}*1]",
                    "tdpbusd tmm0, tmm4, tmm5",
                    "tileloadd tmm6, [{b1} + {ldb}*1]",
                    "tdpbusd tmm1, tmm4, tmm6",
                    "tileloadd tmm7, [{b2} + {ldb}*1]",
                    "tdpbusd tmm2, tmm4, tmm7",
                    "tileloadd tmm5, [{b3} + {ldb}*1]",
                    "tdpbusd tmm3, tmm4, tmm5",
                    a = in(reg) a.add(s * 64),
                    b0 = in(reg) bs,
                    b1 = in(reg) bs.add(1024),
                    b2 = in(reg) bs.add(2048),
                    b3 = in(reg) bs.add(3072),
                    lda = in(reg) lda,
                    ldb = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
            store_sums([c, c.byte_add(64), c.byte_add(128), c.byte_add(192)], 256);
        }
    }

    /// Clears the sum tiles 0–3.
    ///
    /// # Safety
    /// [`Tiles::configure`] is in force on this thread.
    #[inline]
    pub(crate) unsafe fn zero_sums() {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem)) };
    }

    /// Adds to the 32 × 32 f32 sums in tiles 0–3 the three products `a_hi·b_hi + a_lo·b_hi +
    /// a_hi·b_lo` of split bf16 values over `steps` depth steps of 32. Each step of `a` is four
    /// 16 × 64-byte tiles, 1 KiB apart (`hi` rows 0–15, `hi` rows 16–31, `lo` rows 0–15, `lo` rows
    /// 16–31), and each step of `b` four tiles in the pair layout (`hi` columns 0–15, `hi` columns
    /// 16–31, then `lo`); the next step 4 KiB after.
    ///
    /// # Safety
    /// [`Tiles::configure`] is in force on this thread and `a` and `b` hold `steps` steps.
    #[inline]
    pub(crate) unsafe fn add_split_bf16_32x32(a: *const u16, b: *const u16, steps: usize) {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe {
            for s in 0..steps {
                asm!(
                    "tileloadd tmm4, [{a} + {ld}*1]",
                    "tileloadd tmm6, [{b} + {ld}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b} + {ld}*1 + 1024]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a} + {ld}*1 + 1024]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm6, [{b} + {ld}*1 + 2048]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b} + {ld}*1 + 3072]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm4, [{a} + {ld}*1 + 2048]",
                    "tileloadd tmm6, [{b} + {ld}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b} + {ld}*1 + 1024]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a} + {ld}*1 + 3072]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a = in(reg) a.byte_add(s * 4096),
                    b = in(reg) b.byte_add(s * 4096),
                    ld = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
        }
    }

    /// Stores the 32 × 32 f32 sums of tiles 0–3 at `c` (rows `ldc` bytes apart).
    ///
    /// # Safety
    /// [`Tiles::configure`] is in force and `c` has 32 rows of 128 writable bytes, `ldc` apart.
    #[inline]
    pub(crate) unsafe fn store_f32_32x32(c: *mut f32, ldc: usize) {
        // SAFETY: what this function's `# Safety` section requires is what these instructions need.
        unsafe { store_sums([c.cast(), c.byte_add(64).cast(), c.byte_add(16 * ldc).cast(), c.byte_add(16 * ldc + 64).cast()], ldc) };
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::kernels::*;

    /// The guard leaves the thread's tiles as it found them: another kernel's configuration is put
    /// back, and a thread that had none is left without one.
    #[test]
    fn the_tile_guard_restores_the_threads_configuration() {
        if !super::available() {
            return;
        }
        std::thread::spawn(|| {
            // SAFETY: AMX runs here; the configurations are valid 64-byte operands.
            unsafe {
                assert_eq!(stored_config(), [0; 64], "a new thread has no tile configuration");
                drop(Tiles::configure());
                assert_eq!(stored_config(), [0; 64]);
                // Another kernel's: palette 1, tile 0 of 8 rows × 32 bytes.
                let mut other = [0u8; 64];
                other[0] = 1;
                other[16] = 32;
                other[48] = 8;
                load_config(&other);
                let tiles = Tiles::configure();
                assert_ne!(stored_config(), other);
                drop(tiles);
                assert_eq!(stored_config(), other);
                load_config(&[0; 64]);
            }
        })
        .join()
        .unwrap();
    }
}

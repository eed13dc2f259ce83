//! The global allocator of the static (musl) builds: the system allocator plus a small cache of
//! freed large blocks.
//!
//! musl's malloc hands every block above ~128 KiB straight to `mmap` and gives it back with
//! `munmap` on free, so each tensor of a forward pass (a DA-V2-Small layer allocates and frees
//! blocks of 2–45 MB over and over) costs a fresh mapping and one page fault per 4 KiB page.
//! On DA-V2-Small 518×518 that made the musl binary ~30–45 % slower than the glibc one, with 2.3×
//! the page faults and over twice the system time (docs/deploy.md). glibc avoids most of it by
//! keeping freed blocks of up to 32 MiB in its heap.
//!
//! [`CachingAlloc`] keeps up to [`DEFAULT_CACHE_BYTES`] of freed blocks of at least
//! [`MIN_CACHED`] bytes (in [`SLOTS`] slots, oldest evicted first) and hands them back to the next
//! allocation of the same size class and alignment. Sizes are rounded up to classes 1/8 of a
//! power of two apart (at most 12.5 % slack), so tensors whose sizes differ slightly share blocks.
//! Small blocks go straight to the system allocator. `EDGERUN_ALLOC_CACHE_MB` sets the budget
//! (`0` turns the cache off); the peak RSS is at most that much above what the live blocks need.
//! Pure Rust, no dependency, works for every target; only the musl builds install it
//! (`src/main.rs`): glibc's malloc is left alone.
#![cfg_attr(not(target_env = "musl"), allow(dead_code))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// glibc builds: keep freed blocks of every size in malloc's heap for reuse, and never trim it.
/// glibc serves blocks above its (adaptive, at most 32 MiB) mmap threshold with a fresh mapping and
/// returns heap tops above its trim threshold to the kernel, so the largest tensors of a forward pass
/// cost page faults each time (DA-V2-Small 518², 3 passes in one process, paired: 3–6 % faster,
/// system time 0.45 → 0.23 s, peak RSS unchanged). Every thread also allocates from the one main
/// heap: a forward pass runs on a rayon worker, whose own arena is made of 64 MiB heaps that glibc
/// unmaps when they empty and that cannot hold a larger block at all (always a fresh mapping):
/// CHMv2 at 416² took ~120 k page faults per pass. Paired A/B of whole forwards: DA-V2-S 4.0 %
/// faster, DA3-S 3.9 %, CHMv2 0.1–1.6 %; SegFormer-B0's peak RSS 165 → 87 MB.
/// `EDGERUN_ALLOC_CACHE_MB=0` keeps glibc's defaults.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn keep_freed_blocks_in_glibc_heap() {
    use std::ffi::c_int;
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_THRESHOLD: c_int = -3;
    const M_ARENA_MAX: c_int = -8;
    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    if std::env::var_os(BUDGET_VAR).is_some_and(|v| v.to_str().is_some_and(|v| v.trim() == "0")) {
        return;
    }
    // SAFETY: mallopt only sets three of glibc malloc's parameters (it returns 0 for a value it
    // refuses, which leaves that default in place); it is called before any other thread exists.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, c_int::MAX);
        mallopt(M_TRIM_THRESHOLD, c_int::MAX);
        mallopt(M_ARENA_MAX, 1);
    }
}

/// Blocks from this size up are cached (musl's mmap threshold is just under 128 KiB).
pub const MIN_CACHED: usize = 128 << 10;
/// Blocks above this size are never cached (nor rounded).
const MAX_CACHED: usize = 1 << 40;
/// The most bytes the cache holds unless `EDGERUN_ALLOC_CACHE_MB` says otherwise.
pub const DEFAULT_CACHE_BYTES: usize = 128 << 20;
/// The environment variable that sets the cache budget in MiB.
pub const BUDGET_VAR: &str = "EDGERUN_ALLOC_CACHE_MB";
const UNSET: usize = usize::MAX;
/// The most blocks the cache holds.
pub const SLOTS: usize = 64;

/// The size class of a block of `size` bytes, or `None` when such blocks are not cached.
fn class(size: usize) -> Option<usize> {
    if !(MIN_CACHED..=MAX_CACHED).contains(&size) {
        return None;
    }
    let bits = usize::BITS - 1 - size.leading_zeros();
    let grain = 1usize << (bits - 3);
    Some((size + grain - 1) & !(grain - 1))
}

#[derive(Clone, Copy)]
struct Slot {
    ptr: *mut u8,
    size: usize,
    align: usize,
    seq: u64,
}

const EMPTY: Slot = Slot { ptr: ptr::null_mut(), size: 0, align: 0, seq: 0 };

struct Cache {
    slots: [Slot; SLOTS],
    bytes: usize,
    seq: u64,
}

/// Blocks taken out of the cache under the lock, to be freed after it is released.
struct Evicted {
    slots: [Slot; SLOTS],
    n: usize,
}

impl Evicted {
    fn new() -> Self {
        Evicted { slots: [EMPTY; SLOTS], n: 0 }
    }

    /// Moves the oldest cached block here and returns its size (0 when the cache is empty).
    fn evict_oldest(&mut self, c: &mut Cache) -> usize {
        let Some(i) = (0..SLOTS).filter(|&i| !c.slots[i].ptr.is_null()).min_by_key(|&i| c.slots[i].seq) else { return 0 };
        let s = c.slots[i];
        c.slots[i] = EMPTY;
        c.bytes -= s.size;
        self.slots[self.n] = s;
        self.n += 1;
        s.size
    }

    /// # Safety
    /// Each held block was allocated by `System` with its recorded size and alignment, and is freed once.
    unsafe fn free(&self) {
        for s in &self.slots[..self.n] {
            System.dealloc(s.ptr, Layout::from_size_align_unchecked(s.size, s.align));
        }
    }
}

// SAFETY: the cache only stores pointers to blocks nobody else owns; they move between threads
// under the mutex, exactly as freed memory does inside any allocator.
unsafe impl Send for Cache {}

/// The system allocator with a bounded cache of freed large blocks (see the module docs).
pub struct CachingAlloc {
    cache: Mutex<Cache>,
    budget: AtomicUsize,
}

impl CachingAlloc {
    /// An allocator whose budget is read from `EDGERUN_ALLOC_CACHE_MB` on the first large free.
    pub const fn new() -> Self {
        Self::with_budget(UNSET)
    }

    /// An allocator caching at most `bytes`.
    pub const fn with_budget(bytes: usize) -> Self {
        CachingAlloc { cache: Mutex::new(Cache { slots: [EMPTY; SLOTS], bytes: 0, seq: 0 }), budget: AtomicUsize::new(bytes) }
    }

    /// The cache budget in bytes.
    pub fn budget(&self) -> usize {
        let b = self.budget.load(Ordering::Relaxed);
        if b != UNSET {
            return b;
        }
        // Store the default first: reading the variable allocates, and a free of that
        // allocation must not come back here.
        self.budget.store(DEFAULT_CACHE_BYTES, Ordering::Relaxed);
        let b = std::env::var_os(BUDGET_VAR)
            .and_then(|v| v.to_str()?.trim().parse::<usize>().ok())
            .map_or(DEFAULT_CACHE_BYTES, |mb| mb.saturating_mul(1 << 20));
        self.budget.store(b, Ordering::Relaxed);
        b
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        // Nothing can panic while the lock is held; a poisoned lock is still consistent.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the most recently freed cached block of exactly `size` bytes and `align`, or null.
    fn take(&self, size: usize, align: usize) -> *mut u8 {
        let mut c = self.lock();
        let mut best: Option<usize> = None;
        for (i, s) in c.slots.iter().enumerate() {
            if !s.ptr.is_null() && s.size == size && s.align == align && best.is_none_or(|b| c.slots[b].seq < s.seq) {
                best = Some(i);
            }
        }
        let Some(i) = best else { return ptr::null_mut() };
        let p = c.slots[i].ptr;
        c.slots[i] = EMPTY;
        c.bytes -= size;
        p
    }

    /// Caches a freed block, evicting the oldest ones to stay within bounds; frees what is not kept.
    ///
    /// # Safety
    /// `p` was allocated by `System` with `size` bytes at `align` and is not used after this call.
    unsafe fn put(&self, p: *mut u8, size: usize, align: usize) {
        let budget = self.budget();
        if size > budget / 2 {
            System.dealloc(p, Layout::from_size_align_unchecked(size, align));
            return;
        }
        let mut evicted = Evicted::new();
        {
            let mut c = self.lock();
            loop {
                let free = c.slots.iter().position(|s| s.ptr.is_null());
                if let (Some(i), true) = (free, c.bytes + size <= budget) {
                    c.seq += 1;
                    c.slots[i] = Slot { ptr: p, size, align, seq: c.seq };
                    c.bytes += size;
                    break;
                }
                // The cache is full or over budget, so there is a block to evict.
                if evicted.evict_oldest(&mut c) == 0 {
                    drop(c);
                    System.dealloc(p, Layout::from_size_align_unchecked(size, align));
                    break;
                }
            }
        }
        evicted.free();
    }

    /// Bytes held in the cache now.
    #[allow(dead_code)] // for tests and diagnostics
    pub fn cached_bytes(&self) -> usize {
        self.lock().bytes
    }
}

impl Default for CachingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every block handed out is a system block of the class size (or of the requested size
// when not cached) with the requested alignment, and `dealloc`/`realloc` recompute the same class
// from the caller's layout, so each block goes back to the system with the layout it was made with.
unsafe impl GlobalAlloc for CachingAlloc {
    /// # Safety
    /// As [`GlobalAlloc::alloc`]'s.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(size) = class(layout.size()) else { return System.alloc(layout) };
        let p = self.take(size, layout.align());
        if !p.is_null() {
            return p;
        }
        System.alloc(Layout::from_size_align_unchecked(size, layout.align()))
    }

    /// # Safety
    /// As [`GlobalAlloc::alloc_zeroed`]'s.
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let Some(size) = class(layout.size()) else { return System.alloc_zeroed(layout) };
        let p = self.take(size, layout.align());
        if !p.is_null() {
            ptr::write_bytes(p, 0, layout.size());
            return p;
        }
        // A fresh mapping is already zero.
        System.alloc_zeroed(Layout::from_size_align_unchecked(size, layout.align()))
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`]'s.
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        match class(layout.size()) {
            Some(size) => self.put(p, size, layout.align()),
            None => System.dealloc(p, layout),
        }
    }

    /// # Safety
    /// As [`GlobalAlloc::realloc`]'s.
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match (class(layout.size()), class(new_size)) {
            (None, None) => System.realloc(p, layout, new_size),
            (Some(a), Some(b)) if a == b => p,
            // Large to large: let the system move or grow it (musl uses mremap), in class sizes.
            (Some(a), Some(b)) => System.realloc(p, Layout::from_size_align_unchecked(a, layout.align()), b),
            _ => {
                let q = self.alloc(Layout::from_size_align_unchecked(new_size, layout.align()));
                if !q.is_null() {
                    ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                    self.dealloc(p, layout);
                }
                q
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_and_stay_close() {
        assert_eq!(class(MIN_CACHED - 1), None);
        assert_eq!(class(MAX_CACHED + 1), None);
        let mut prev = 0;
        for size in (MIN_CACHED..64 << 20).step_by(4093) {
            let c = class(size).unwrap();
            assert!(c >= size && c - size <= size / 8, "{size} -> {c}");
            assert!(c >= prev, "classes are monotone");
            assert_eq!(c % 4096, 0);
            prev = c;
        }
        assert_eq!(class(MIN_CACHED), Some(MIN_CACHED));
        assert_eq!(class(MIN_CACHED + 1), class(MIN_CACHED + (16 << 10)));
    }

    fn fill(p: *mut u8, n: usize, v: u8) {
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe { ptr::write_bytes(p, v, n) }
    }

    fn all(p: *mut u8, n: usize, v: u8) -> bool {
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe { std::slice::from_raw_parts(p, n) }.iter().all(|&b| b == v)
    }

    #[test]
    fn freed_large_blocks_are_reused_and_zeroed_on_request() {
        let a = CachingAlloc::with_budget(DEFAULT_CACHE_BYTES);
        let l = Layout::from_size_align(3 << 20, 64).unwrap();
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe {
            let p = a.alloc(l);
            assert!(!p.is_null() && (p as usize).is_multiple_of(64));
            fill(p, l.size(), 7);
            a.dealloc(p, l);
            assert_eq!(a.cached_bytes(), class(l.size()).unwrap());
            // A slightly different size in the same class gets the same block back.
            let l2 = Layout::from_size_align(l.size() - 1000, 64).unwrap();
            let q = a.alloc_zeroed(l2);
            assert_eq!(q, p);
            assert!(all(q, l2.size(), 0));
            assert_eq!(a.cached_bytes(), 0);
            // Another alignment is not served from the cache.
            a.dealloc(q, l2);
            let l3 = Layout::from_size_align(l.size(), 4096).unwrap();
            let r = a.alloc(l3);
            assert!(r != p && (r as usize).is_multiple_of(4096));
            assert_eq!(a.cached_bytes(), class(l.size()).unwrap());
            a.dealloc(r, l3);
            assert_eq!(a.cached_bytes(), 2 * class(l.size()).unwrap());
        }
    }

    #[test]
    fn small_blocks_bypass_the_cache() {
        let a = CachingAlloc::with_budget(DEFAULT_CACHE_BYTES);
        let l = Layout::from_size_align(1000, 8).unwrap();
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe {
            let p = a.alloc(l);
            a.dealloc(p, l);
        }
        assert_eq!(a.cached_bytes(), 0);
    }

    #[test]
    fn cache_stays_within_its_budget() {
        let a = CachingAlloc::with_budget(DEFAULT_CACHE_BYTES);
        let l = Layout::from_size_align(DEFAULT_CACHE_BYTES / 6, 16).unwrap();
        let small = Layout::from_size_align(200 << 10, 16).unwrap();
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe {
            let ps: Vec<_> = (0..10).map(|_| a.alloc(l)).collect();
            for p in ps {
                a.dealloc(p, l);
            }
            assert!(a.cached_bytes() <= DEFAULT_CACHE_BYTES);
            assert_eq!(a.cached_bytes(), DEFAULT_CACHE_BYTES / class(l.size()).unwrap() * class(l.size()).unwrap());
            let ps: Vec<_> = (0..SLOTS + 10).map(|_| a.alloc(small)).collect();
            for p in ps {
                a.dealloc(p, small);
            }
            assert!(a.cached_bytes() <= DEFAULT_CACHE_BYTES);
            // Too big to cache at all.
            let huge = Layout::from_size_align(DEFAULT_CACHE_BYTES, 16).unwrap();
            let before = a.cached_bytes();
            let p = a.alloc(huge);
            a.dealloc(p, huge);
            assert_eq!(a.cached_bytes(), before);
        }
    }

    #[test]
    fn realloc_keeps_contents_across_classes() {
        let a = CachingAlloc::with_budget(DEFAULT_CACHE_BYTES);
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe {
            let mut l = Layout::from_size_align(1000, 8).unwrap();
            let mut p = a.alloc(l);
            fill(p, l.size(), 3);
            for new in [300 << 10, 310 << 10, 5 << 20, 200 << 10, 100] {
                let keep = l.size().min(new);
                p = a.realloc(p, l, new);
                assert!(!p.is_null());
                assert!(all(p, keep, 3), "contents kept growing/shrinking to {new}");
                l = Layout::from_size_align(new, 8).unwrap();
                fill(p, l.size(), 3);
            }
            a.dealloc(p, l);
        }
    }

    #[test]
    fn a_zero_budget_turns_the_cache_off() {
        let a = CachingAlloc::with_budget(0);
        let l = Layout::from_size_align(1 << 20, 16).unwrap();
        // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
        unsafe {
            let p = a.alloc(l);
            a.dealloc(p, l);
        }
        assert_eq!(a.cached_bytes(), 0);
        assert_eq!(a.budget(), 0);
    }

    #[test]
    fn threads_share_one_cache() {
        let a = std::sync::Arc::new(CachingAlloc::with_budget(DEFAULT_CACHE_BYTES));
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let a = a.clone();
                // SAFETY: the test owns these blocks: it frees each once, with the layout it allocated it with.
                std::thread::spawn(move || unsafe {
                    for i in 0..200 {
                        let l = Layout::from_size_align((1 << 20) + (i % 7) * 100_000, 32).unwrap();
                        let p = a.alloc(l);
                        fill(p, l.size(), t as u8);
                        assert!(all(p, l.size(), t as u8));
                        a.dealloc(p, l);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert!(a.cached_bytes() <= DEFAULT_CACHE_BYTES);
    }
}

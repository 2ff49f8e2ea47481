//! Spreading independent copy jobs over the machine's cores (std scoped threads).
//!
//! A memcpy from one core does not saturate memory bandwidth on common machines (and
//! glibc switches to streaming stores only for copies larger than most shards), so the
//! data paths split their disjoint copies across cores when there is enough to copy.

/// Below this many bytes a copy runs on the calling thread: spawning costs more.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Runs `f` on every job, spreading jobs over the available cores when their total
/// weight (bytes) is large. Jobs are assigned largest first to the least-loaded thread.
pub(crate) fn run_jobs<J: Send>(jobs: Vec<(usize, J)>, f: &(dyn Fn(J) + Sync)) {
    let total: usize = jobs.iter().map(|(w, _)| w).sum();
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(jobs.len());
    if threads <= 1 || total < PARALLEL_MIN_BYTES {
        jobs.into_iter().for_each(|(_, job)| f(job));
        return;
    }
    let mut jobs = jobs;
    jobs.sort_by_key(|(w, _)| std::cmp::Reverse(*w));
    let mut groups: Vec<(usize, Vec<J>)> = (0..threads).map(|_| (0, Vec::new())).collect();
    for (weight, job) in jobs {
        let least = groups.iter_mut().min_by_key(|(load, _)| *load).expect("threads >= 1");
        least.0 += weight;
        least.1.push(job);
    }
    let mut groups = groups.into_iter().map(|(_, g)| g);
    let first = groups.next().expect("threads >= 1");
    std::thread::scope(|scope| {
        for group in groups {
            scope.spawn(move || group.into_iter().for_each(f));
        }
        first.into_iter().for_each(f);
    });
}

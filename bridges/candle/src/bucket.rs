//! Gradient buckets: which parameters travel together in one fused flat buffer.
//!
//! As PyTorch's DDP does, parameters are taken in reverse order (the order their
//! gradients become ready in a backward pass), one open bucket per dtype; a bucket is
//! closed when the next parameter would take it past the size limit (a parameter
//! larger than the limit travels alone). Every bucket's buffer holds its parameters'
//! values one after another, then one flag per parameter (1 when the replica has a
//! gradient for it), so replicas agree on which parameters the optimizer steps.

/// The element type of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

impl Kind {
    /// candle's dtype of this kind.
    pub(crate) fn dtype(self) -> candle_core::DType {
        match self {
            Kind::F32 => candle_core::DType::F32,
            Kind::F64 => candle_core::DType::F64,
        }
    }

    /// Bytes per element.
    pub(crate) fn size(self) -> usize {
        match self {
            Kind::F32 => 4,
            Kind::F64 => 8,
        }
    }
}

/// One bucket: parameter indices (in the order they are packed) and the elements each
/// contributes to the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// The element type.
    pub(crate) kind: Kind,
    /// Parameter indices, in packing order.
    pub(crate) params: Vec<usize>,
    /// Elements of each, in the same order.
    pub(crate) lens: Vec<usize>,
}

impl Bucket {
    /// The buffer's elements: the values, then one flag per parameter.
    pub(crate) fn buffer_len(&self) -> usize {
        self.lens.iter().sum::<usize>() + self.params.len()
    }

    /// Where parameter `k` (of this bucket) starts in the buffer.
    pub(crate) fn offsets(&self) -> Vec<usize> {
        self.lens
            .iter()
            .scan(0, |at, &n| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect()
    }
}

/// Buckets of at most `limit` bytes for parameters of `(elements, kind)`, taken in
/// reverse order; the buckets come out in the order they fill (the first holds the
/// last parameters).
pub(crate) fn plan(params: &[(usize, Kind)], limit: usize) -> Vec<Bucket> {
    let mut done = Vec::new();
    let mut open: Vec<Bucket> = Vec::new();
    for (k, &(len, kind)) in params.iter().enumerate().rev() {
        let bytes = len * kind.size();
        let at = open.iter().position(|b| b.kind == kind);
        if let Some(i) = at {
            let used: usize = open[i].lens.iter().sum::<usize>() * kind.size();
            if used + bytes > limit {
                done.push(open.remove(i));
            }
        }
        match open.iter_mut().find(|b| b.kind == kind) {
            Some(b) => {
                b.params.push(k);
                b.lens.push(len);
            }
            None => open.push(Bucket { kind, params: vec![k], lens: vec![len] }),
        }
    }
    done.extend(open);
    done
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Every parameter is in exactly one bucket of its kind; within a kind,
        /// buckets follow reverse parameter order; a bucket stays within the limit
        /// unless it holds one parameter alone.
        #[test]
        fn buckets_cover_every_parameter_once_in_reverse_order(
            params in proptest::collection::vec((0usize..5000, any::<bool>()), 0..60),
            limit in 1usize..40_000,
        ) {
            let params: Vec<(usize, Kind)> = params
                .into_iter()
                .map(|(n, wide)| (n, if wide { Kind::F64 } else { Kind::F32 }))
                .collect();
            let buckets = plan(&params, limit);
            let mut seen = vec![0; params.len()];
            for b in &buckets {
                prop_assert!(!b.params.is_empty());
                let bytes: usize = b.lens.iter().sum::<usize>() * b.kind.size();
                prop_assert!(bytes <= limit || b.params.len() == 1, "{b:?} over {limit}");
                for (&k, &len) in b.params.iter().zip(&b.lens) {
                    seen[k] += 1;
                    prop_assert_eq!(params[k], (len, b.kind));
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
            for kind in [Kind::F32, Kind::F64] {
                let order: Vec<usize> = buckets
                    .iter()
                    .filter(|b| b.kind == kind)
                    .flat_map(|b| b.params.clone())
                    .collect();
                let mut want: Vec<usize> =
                    (0..params.len()).filter(|&k| params[k].1 == kind).collect();
                want.reverse();
                prop_assert_eq!(order, want);
            }
        }
    }

    #[test]
    fn a_parameter_larger_than_the_limit_travels_alone() {
        let p = [(10, Kind::F32), (1000, Kind::F32), (10, Kind::F32)];
        let b = plan(&p, 100);
        let groups: Vec<Vec<usize>> = b.iter().map(|b| b.params.clone()).collect();
        assert_eq!(groups, vec![vec![2], vec![1], vec![0]]);
        assert_eq!(b[0].buffer_len(), 11);
        let b = plan(&p, 1 << 20);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].offsets(), vec![0, 10, 1010]);
    }
}

//! Dataflow graphs to place: named nodes with requested/assigned devices and colocation
//! lists, data edges between numbered outputs and inputs, and control edges.

use rustc_hash::FxHashMap;

use petgraph::graph::{DiGraph, EdgeIndex, NodeIndex};

use crate::{Error, Result};

/// A node of the graph.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    /// Unique name.
    pub name: String,
    /// Op name, looked up in the [`OpRegistry`](crate::OpRegistry).
    pub op: String,
    /// The user's (possibly partial, possibly malformed) device request; empty for none.
    pub requested_device: String,
    /// A device the framework already placed this node on (a full name), if any.
    pub assigned_device: Option<String>,
    /// Colocation targets (`loc:@name`, without the prefix), in order.
    pub colocation: Vec<String>,
}

impl Node {
    /// A node with no device request and no colocation.
    pub fn new(name: &str, op: &str) -> Node {
        Node { name: name.to_owned(), op: op.to_owned(), ..Node::default() }
    }

    /// This node with a device request.
    pub fn on(mut self, device: &str) -> Node {
        self.requested_device = device.to_owned();
        self
    }

    /// This node already assigned to `device`.
    pub fn assigned(mut self, device: &str) -> Node {
        self.assigned_device = Some(device.to_owned());
        self
    }

    /// This node colocated with `targets` (`loc:@target` each).
    pub fn colocate_with(mut self, targets: &[&str]) -> Node {
        self.colocation.extend(targets.iter().map(|t| (*t).to_owned()));
        self
    }
}

/// An edge: data from output `src_output` to input `dst_input`, or control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Edge {
    /// A data edge.
    Data {
        /// The source's output index.
        src_output: usize,
        /// The destination's input index.
        dst_input: usize,
    },
    /// A control edge (ordering only).
    Control,
}

/// A node's index in its graph (TF's node id order: the order nodes were added).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    /// The index, `0..graph.len()`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A dataflow graph in a `petgraph` `DiGraph`. Node and edge order is insertion order,
/// which is the order TF processes them in.
#[derive(Debug, Clone)]
pub struct Graph {
    graph: DiGraph<Node, Edge, u32>,
    /// Every distinct string of the graph (node names, ops, requests, colocation
    /// targets), so the placer works on small integers: equal strings, equal ids. Id 0
    /// is the empty string.
    strings: Vec<String>,
    string_ids: FxHashMap<String, u32>,
    /// Per string: the node of that name, or `u32::MAX`.
    node_of_string: Vec<u32>,
    /// Per node: the string ids of its name, op and request.
    name_ids: Vec<u32>,
    op_ids: Vec<u32>,
    request_ids: Vec<u32>,
    /// Per node: the string ids of its colocation targets (flat, `coloc_start[i]..`).
    coloc_start: Vec<u32>,
    coloc_ids: Vec<u32>,
}

/// The interned view of a graph the placer works from.
pub(crate) struct Interned<'a> {
    pub(crate) strings: &'a [String],
    pub(crate) name_ids: &'a [u32],
    pub(crate) op_ids: &'a [u32],
    pub(crate) request_ids: &'a [u32],
    pub(crate) coloc_start: &'a [u32],
    pub(crate) coloc_ids: &'a [u32],
}

impl Interned<'_> {
    /// The string ids of node `i`'s colocation targets.
    pub(crate) fn colocation(&self, i: usize) -> &[u32] {
        &self.coloc_ids[self.coloc_start[i] as usize..self.coloc_start[i + 1] as usize]
    }
}

/// The string id of `""`.
pub(crate) const EMPTY: u32 = 0;

impl Default for Graph {
    fn default() -> Graph {
        let mut string_ids = FxHashMap::default();
        string_ids.insert(String::new(), EMPTY);
        Graph {
            graph: DiGraph::default(),
            strings: vec![String::new()],
            string_ids,
            node_of_string: vec![u32::MAX],
            name_ids: Vec::new(),
            op_ids: Vec::new(),
            request_ids: Vec::new(),
            coloc_start: vec![0],
            coloc_ids: Vec::new(),
        }
    }
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Adds a node; names must be unique.
    pub fn add_node(&mut self, node: Node) -> Result<NodeId> {
        let name = self.intern(&node.name);
        if self.node_of_string[name as usize] != u32::MAX {
            return Err(Error::DuplicateNode { name: node.name });
        }
        let op = self.intern(&node.op);
        let request = self.intern(&node.requested_device);
        for target in &node.colocation {
            let t = self.intern(target);
            self.coloc_ids.push(t);
        }
        self.coloc_start.push(self.coloc_ids.len() as u32);
        self.name_ids.push(name);
        self.op_ids.push(op);
        self.request_ids.push(request);
        let index = self.graph.add_node(node);
        self.node_of_string[name as usize] = index.index() as u32;
        Ok(NodeId(index.index() as u32))
    }

    /// Adds a data edge `src:src_output → dst:dst_input` between named nodes.
    pub fn add_edge(
        &mut self,
        src: &str,
        src_output: usize,
        dst: &str,
        dst_input: usize,
    ) -> Result<()> {
        let (s, d) = (self.lookup(src, dst)?, self.lookup(dst, src)?);
        self.graph.add_edge(s, d, Edge::Data { src_output, dst_input });
        Ok(())
    }

    /// Adds a control edge `src → dst` between named nodes.
    pub fn add_control_edge(&mut self, src: &str, dst: &str) -> Result<()> {
        let (s, d) = (self.lookup(src, dst)?, self.lookup(dst, src)?);
        self.graph.add_edge(s, d, Edge::Control);
        Ok(())
    }

    fn intern(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.string_ids.get(s) {
            return id;
        }
        let id = self.strings.len() as u32;
        self.strings.push(s.to_owned());
        self.string_ids.insert(s.to_owned(), id);
        self.node_of_string.push(u32::MAX);
        id
    }

    /// The interned view (string ids per node).
    pub(crate) fn interned(&self) -> Interned<'_> {
        Interned {
            strings: &self.strings,
            name_ids: &self.name_ids,
            op_ids: &self.op_ids,
            request_ids: &self.request_ids,
            coloc_start: &self.coloc_start,
            coloc_ids: &self.coloc_ids,
        }
    }

    fn lookup(&self, name: &str, other_end: &str) -> Result<NodeIndex<u32>> {
        self.id(name).map(|id| NodeIndex::new(id.index())).ok_or_else(|| Error::UnknownNode {
            name: name.to_owned(),
            referenced_by: other_end.to_owned(),
        })
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.graph.node_count()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.graph.node_count() == 0
    }

    /// The node with this id.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.graph[NodeIndex::new(id.index())]
    }

    /// The id of the node called `name`.
    pub fn id(&self, name: &str) -> Option<NodeId> {
        let s = *self.string_ids.get(name)?;
        let node = self.node_of_string[s as usize];
        (node != u32::MAX).then_some(NodeId(node))
    }

    /// The nodes with their ids, in id order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.graph.node_indices().map(|i| (NodeId(i.index() as u32), &self.graph[i]))
    }

    /// The edges `(src, dst, edge)`, in the order they were added.
    pub fn edges(&self) -> impl Iterator<Item = (NodeId, NodeId, Edge)> + '_ {
        self.graph.edge_indices().map(|e| self.edge(e))
    }

    fn edge(&self, e: EdgeIndex<u32>) -> (NodeId, NodeId, Edge) {
        let (s, d) = self.graph.edge_endpoints(e).expect("edge index in range");
        (NodeId(s.index() as u32), NodeId(d.index() as u32), self.graph[e])
    }

    /// The underlying `petgraph` graph.
    pub fn petgraph(&self) -> &DiGraph<Node, Edge, u32> {
        &self.graph
    }
}
